"""The commands' output files, checked before any work starts: a run that embeds or evaluates
for minutes must not end in a traceback because its output cannot be written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

__all__ = ["output_file_problem"]


def output_file_problem(path: Union[str, Path]) -> Optional[str]:
    """Why ``path`` cannot be created or replaced as a file by this process (None: it can)."""
    path = Path(path)
    folder = path.parent  # Path("x.npy").parent is Path(".")
    if path.is_dir():
        return "is a folder; name the output file"
    if not folder.is_dir():
        return f"no folder {folder} to write it in"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot write in {folder}"
    if path.exists() and not os.access(path, os.W_OK):
        return "exists and cannot be overwritten"
    return None
