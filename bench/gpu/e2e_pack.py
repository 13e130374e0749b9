"""The pack that travels to the GPU machine: wheels of the engine's missing dependencies and
SmolLM2's tokenizer files, in one ignored folder (`.gpu/`, copied to the GPU machine with the tree).

    python bench/gpu/e2e_pack.py download [--dest .gpu]        here: `make gpu-wheels`
    python bench/gpu/e2e_pack.py install --wheels .gpu/wheels --target DIR [--cross] --json J

`download` fetches, for the device's Python (3.12, CPython, manylinux x86_64), the wheel of every
package in `WHEEL_PACKAGES` at the version installed here (what the tests ran with), without
dependencies; then checks that every requirement of every wheel is either in the folder or in
`DEVICE_PREINSTALLED` (what the GPU machine's image holds), copies SmolLM2's
tokenizer.json, tokenizer_config.json and config.json from the converted model, and checks that
the working tree plus the pack stays under `COPY_LIMIT` (what one copy to the machine may hold).

`install` runs `pip install --no-index --no-deps --target DIR` (the device's python3 is itself a
venv holding CUDA torch and triton: a nested venv would not see them, a target folder on
PYTHONPATH does), then imports every module the engine needs from there. `--cross` (the CPU dry
run, whose Python may be another version) installs for the device's platform tags into a
scratch folder and checks the modules against the interpreter running it instead.
Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
PYTHON_VERSION = "3.12"  # the GPU machine's python3 (3.12.3)
PLATFORMS = (
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux1_x86_64",
)
COPY_LIMIT = 64 << 20  # bytes: working tree + .gpu/, what one copy to the GPU machine may hold
# The engine's dependencies the device lacks, and theirs (fastapi: starlette, pydantic...).
# typing-extensions is there, but pydantic needs a recent one: ours shadows it on PYTHONPATH.
WHEEL_PACKAGES = (
    "pyzmq",
    "structlog",
    "orjson",
    "gguf",
    "fastapi",
    "starlette",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "opentelemetry-api",
    "typing-extensions",
    "uvicorn",
)
# Import name -> what needs it. Installed here from the wheels, or already on the device.
ENGINE_MODULES = (
    "zmq",
    "msgpack",
    "structlog",
    "orjson",
    "numpy",
    "gguf",
    "safetensors",
    "tokenizers",
    "jinja2",
    "prometheus_client",
    "fastapi",
    "uvicorn",
    "pydantic",
)
GATEWAY_MODULES = ("fastapi", "uvicorn", "pydantic")
HEAVY_MODULES = ("torch", "triton", "transformers")  # found, not imported (seconds each)
# The GPU machine image's Python packages (as listed on 2026-11-17).
DEVICE_PREINSTALLED = frozenset(
    """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---- download (here) -------------------------------------------------------------------------


def download(dest: Path) -> int:
    from importlib.metadata import version

    wheels = dest / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    pins = [f"{name}=={version(name)}" for name in WHEEL_PACKAGES]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        "-d",
        str(wheels),
    ]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + pins, check=True)
    missing = unmet_requirements(wheels)
    if missing:
        print(f"gpu-wheels: requirements neither in {wheels} nor on the device: {missing}")
        return 1
    copy_tokenizer(dest / "smollm2")
    return report_size(dest)


def unmet_requirements(wheels: Path) -> list[str]:
    """Requirements (for Python 3.12 on Linux, extras ignored) that no wheel and no
    preinstalled package of the device provides."""
    from packaging.requirements import Requirement

    env = {
        "python_version": PYTHON_VERSION,
        "python_full_version": f"{PYTHON_VERSION}.3",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "implementation_name": "cpython",
        "platform_machine": "x86_64",
        "extra": "",
    }
    have = {canonical(p.name.split("-")[0]) for p in wheels.glob("*.whl")} | DEVICE_PREINSTALLED
    missing = set()
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode().splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            if canonical(req.name) not in have:
                missing.add(f"{req.name} (for {wheel.name})")
    return sorted(missing)


def copy_tokenizer(dest: Path) -> None:
    """SmolLM2's tokenizer files from the converted model (`conveyor model prepare`)."""
    sys.path.insert(0, str(ROOT))
    from shared.model_files import prepare_model

    folder = prepare_model(None)
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(folder / name, dest / name)


def report_size(dest: Path) -> int:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    tree = sum(
        (ROOT / os.fsdecode(p)).stat().st_size
        for p in listed
        if p and (ROOT / os.fsdecode(p)).is_file()
    )
    pack = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    total = tree + pack
    print(
        f"gpu-wheels: working tree {tree / 2**20:.1f} MiB + {dest} {pack / 2**20:.1f} MiB "
        f"= {total / 2**20:.1f} MiB of the {COPY_LIMIT >> 20} MiB one copy may hold"
    )
    return 0 if total <= COPY_LIMIT else 1


# ---- install (device, or cross-checked in the dry run) -----------------------------------------


PROBE = """
import importlib, importlib.util, json, sys
out = {}
for name in sys.argv[1].split(","):
    try:
        mod = importlib.import_module(name)
        out[name] = {"ok": True, "version": str(getattr(mod, "__version__", "")),
                     "file": str(getattr(mod, "__file__", ""))}
    except Exception as exc:
        out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
for name in sys.argv[2].split(","):
    out[name] = {"ok": importlib.util.find_spec(name) is not None, "found_only": True}
print(json.dumps(out))
"""


def install(wheels: Path, target: Path, cross: bool) -> dict[str, Any]:
    """Install the pack's wheels (when there are any), then import the engine's modules."""
    files = sorted(str(p) for p in wheels.glob("*.whl")) if wheels.is_dir() else []
    result: dict[str, Any] = {"wheels": [Path(f).name for f in files], "target": str(target),
                              "cross": cross}  # fmt: skip
    if files:
        result.update(pip_install(files, target, cross))
    else:
        result["note"] = f"no wheels in {wheels} (`make gpu-wheels`): modules of this environment"
    modules = probe_modules(None if cross else target)
    result["modules"] = modules
    result["gateway"] = all(modules.get(m, {}).get("ok") for m in GATEWAY_MODULES)
    required = [m for m in ENGINE_MODULES + HEAVY_MODULES if m not in GATEWAY_MODULES]
    result["ok"] = (
        result.get("pip_rc", 0) == 0
        and not result.get("not_installed")
        and all(modules.get(m, {}).get("ok") for m in required)
    )
    return result


def pip_install(files: list[str], target: Path, cross: bool) -> dict[str, Any]:
    """`pip install --no-index --no-deps --target`; `cross`: for the device's tags."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target)]  # fmt: skip
    if cross:
        cmd += ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
    proc = subprocess.run(cmd + files, capture_output=True, text=True)
    out: dict[str, Any] = {"pip_rc": proc.returncode}
    if proc.returncode != 0:
        out["pip_error"] = (proc.stdout + proc.stderr)[-2000:]
    installed = {canonical(p.name.split("-")[0]) for p in target.glob("*.dist-info")}
    out["not_installed"] = sorted(
        canonical(n) for n in WHEEL_PACKAGES if canonical(n) not in installed
    )
    return out


def probe_modules(target: Optional[Path]) -> dict[str, Any]:
    """Import every module the engine needs in a fresh interpreter, `target` first on its path
    (as every later stage will have it); the heavy preinstalled ones are only found."""
    env = dict(os.environ)
    if target is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, ",".join(ENGINE_MODULES), ",".join(HEAVY_MODULES)],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if probe.returncode != 0:
        return {"probe": {"ok": False, "error": probe.stderr[-1000:]}}
    return json.loads(probe.stdout)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download", help="wheels + tokenizer into DEST (here, with a registry)")
    d.add_argument("--dest", type=Path, default=ROOT / ".gpu")
    i = sub.add_parser("install", help="pip install --no-index --target, then import")
    i.add_argument("--wheels", type=Path, default=ROOT / ".gpu" / "wheels")
    i.add_argument("--target", type=Path, required=True)
    i.add_argument("--cross", action="store_true", help="install for the device's tags only")
    i.add_argument("--json", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.command == "download":
        return download(args.dest)
    start = time.perf_counter()
    result = install(args.wheels, args.target, args.cross)
    result["seconds"] = round(time.perf_counter() - start, 2)
    print(
        f"gpu_e2e_pack: install: ok={result['ok']} gateway={result['gateway']} "
        f"wheels={len(result['wheels'])} {result.get('not_installed') or ''}",
        flush=True,
    )
    args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
