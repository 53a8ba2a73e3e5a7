"""fusedenc.distributed on a two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``:
a head and a worker node, one CPU each, so the job's two actors sit on different nodes): the
embeddings equal the single-process ones, every id exactly once."""

from __future__ import annotations

import os

import numpy as np
import pytest

import fusedenc.embed

ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "fusedenc[ray]")')
st_helpers = pytest.importorskip("st_helpers")


@pytest.mark.slow
def test_embed_on_two_nodes_equals_one_process(tmp_path):
    from ray.cluster_utils import Cluster

    from fusedenc import distributed

    folder = str(st_helpers.hf_model_dir(tmp_path, "bert", seed=9))
    pool = st_helpers.sentences()
    texts = [pool[(i * 53) % len(pool)] for i in range(400)]
    want, _ = fusedenc.embed.encode(fusedenc.embed.load_model(folder, device="cpu"), texts)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}})  # fmt: skip
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        ds = ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(texts)])
        rows = distributed.embed(ds, folder, device="cpu", concurrency=2, block_rows=40).take_all()
    finally:
        ray.shutdown()
        cluster.shutdown()
    ids = [r["id"] for r in rows]
    assert sorted(ids) == list(range(400))
    got = np.stack([r["embedding"] for r in sorted(rows, key=lambda r: r["id"])])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
