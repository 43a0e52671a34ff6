"""A full disk leaves no half-written file behind in the model library.

Finding (issue 29): after ENOSPC during a stage fetch, 0-byte temp files stayed beside the stage
file in the library: the index, manifest and hash-cache writes were hand-written temp-file-and-rename
copies that did not clean up when the write failed. They now use the one atomic writer
(``write_private``: temp file, fsync, rename; the temp file removed on any failure). The stage file
itself is fetched under ``incoming/`` and renamed into ``stages/`` only once complete and synced.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

from tinymodels import write_tiny_llama

WRITER = """
import sys
from pathlib import Path
from meshllm.models.library import Library
library = Library(Path(sys.argv[1]))
entry = library.add(Path(sys.argv[2]), source="folder", owned=False)
try:
    library.manifest(entry)
except OSError as exc:
    print("manifest:", exc.strerror)
"""


def test_a_failed_library_write_leaves_no_temp_file(tmp_path: Path) -> None:
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", seed=0)
    root = tmp_path / "models"

    def small_files() -> None:  # every file the writer makes may hold 300 bytes: the disk "fills up"
        resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))

    done = subprocess.run([sys.executable, "-c", WRITER, str(root), str(gguf)], capture_output=True, text=True,
                          timeout=60, preexec_fn=small_files)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    print(f"exit {done.returncode}; {done.stdout.strip()} {done.stderr.strip()[-200:]}; library files: {files}")
    assert not [f for f in files if f.endswith(".tmp")], f"a failed write left temp files: {files}"
