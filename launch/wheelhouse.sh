#!/usr/bin/env bash
# An offline install: the wheels of everything elastic-oneshot needs that an existing torch environment lacks, for
# another machine's Python and platform, in one directory; then the `pip install --no-index` line that installs them
# there. Nothing the target already has is fetched (torch, nvidia-*, transformers, ...): each wheel is fetched alone
# (--no-deps) and its requirements are followed from its metadata, for the target's Python, up to what the target
# holds; every requirement on what it holds is checked against the versions known. A package the registry has only
# as a source archive (etcd3 0.12.0) is built here into a wheel, if pure Python.
#
#   launch/wheelhouse.sh                        # for the GPU machine: cp312, manylinux x86_64, its image's packages
#   launch/wheelhouse.sh --peer                 # also llmcompressor 0.14, for bench/gpu.py and the parity tests
#   launch/wheelhouse.sh --python 3.11 --platform manylinux_2_36_x86_64 --have /tmp/venv/bin/python --dest /tmp/wh
#
# Options (defaults in brackets):
#   --python X.Y        the target's Python [3.12; or --have's interpreter's]
#   --platform TAG      the target's newest manylinux tag; every older one is accepted too [manylinux_2_39_x86_64]
#   --have WHAT         what the target holds: a file of `pip freeze` lines or names, or a Python interpreter to ask
#                       [launch/gpu-image.txt: the GPU machine's image]
#   --peer              add llmcompressor==0.14.* (the peer of bench/ and the parity tests)
#   --constraints FILE  the versions to fetch where listed [launch/wheelhouse-constraints.txt: those tested here]
#   --no-project        leave out elastic-oneshot's own wheel (built from this checkout)
#   --dest DIR          where the wheels go; emptied first [.wheelhouse in the checkout, git-ignored]
#   --check             only check DIR's size: the device tool carries the checkout and the wheels within 64 MiB, so
#                       a wheelhouse over 60 MiB (WHEELHOUSE_LIMIT_MIB) is refused, here and at the end of every build
#                       for its GPU image (the default --have)
# Environment: PYTHON, the interpreter whose pip downloads [python3]. pip's own configuration (indexes, find-links,
# certificates) is used, but not a configured constraint file (PIP_CONSTRAINT is cleared): it is about this machine.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
TARGET_PYTHON="" PLATFORM="manylinux_2_39_x86_64" HAVE="$ROOT/launch/gpu-image.txt" PEER=0 PROJECT=1 CHECK=0
LIMIT_MIB="${WHEELHOUSE_LIMIT_MIB:-60}"
CONSTRAINTS="$ROOT/launch/wheelhouse-constraints.txt"
DEST="$ROOT/.wheelhouse"
while [ $# -gt 0 ]; do
    case "$1" in
        --python) TARGET_PYTHON="$2"; shift 2 ;;
        --platform) PLATFORM="$2"; shift 2 ;;
        --have) HAVE="$2"; shift 2 ;;
        --peer) PEER=1; shift ;;
        --constraints) CONSTRAINTS="$2"; shift 2 ;;
        --no-project) PROJECT=0; shift ;;
        --dest) DEST="$2"; shift 2 ;;
        --check) CHECK=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "wheelhouse.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
check_size() {  # refuses (removes) a wheelhouse the device tool could not carry beside the checkout
    local bytes
    bytes=$(find "$DEST" -maxdepth 1 -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
    if [ "$bytes" -gt $((LIMIT_MIB * 1048576)) ]; then
        echo "wheelhouse.sh: $DEST holds $((bytes / 1048576)) MiB of wheels, over $LIMIT_MIB MiB: the device tool carries" \
             "the checkout and its carried paths within 64 MiB. Removed; the largest were:" >&2
        find "$DEST" -maxdepth 1 -name '*.whl' -printf '%s %f\n' | sort -rn | head -5 \
            | awk '{printf "  %6.1f MiB  %s\n", $1 / 1048576, $2}' >&2
        rm -f "$DEST"/*.whl "$DEST"/requirements.txt
        return 1
    fi
    echo "wheelhouse.sh: $((bytes / 1048576)) MiB of wheels in $DEST, within $LIMIT_MIB MiB" >&2
}
if [ "$CHECK" = 1 ]; then
    check_size
    exit
fi
export PIP_CONSTRAINT="" PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
rm -f "$DEST"/*.whl "$DEST"/requirements.txt
if [ -x "$HAVE" ] && [ ! -d "$HAVE" ] && "$HAVE" -c 'import sys' 2>/dev/null; then  # an interpreter: ask it
    [ -n "$TARGET_PYTHON" ] || TARGET_PYTHON="$("$HAVE" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    "$HAVE" -c 'from importlib import metadata
for d in metadata.distributions(): print(d.metadata["Name"] + "==" + d.version)' >"$DEST/.have"
else
    cp "$HAVE" "$DEST/.have"
fi
[ -n "$TARGET_PYTHON" ] || TARGET_PYTHON=3.12
if [ "$PROJECT" = 1 ]; then  # elastic-oneshot itself, from this checkout
    build="$(mktemp -d)"
    "$PY" -m pip wheel -q --no-deps -w "$build" "$ROOT" >&2
    mv "$build"/elastic_oneshot-*.whl "$DEST"/ && rm -r "$build"
fi

"$PY" - "$ROOT" "$DEST" "$TARGET_PYTHON" "$PLATFORM" "$PEER" "$CONSTRAINTS" <<'PYTHON'
import email.parser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

try:
    import tomllib
except ImportError:
    from pip._vendor import tomli as tomllib
try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

root, dest, python, platform, peer, constraints_file = sys.argv[1:7]
major, minor = map(int, python.split(".")[:2])
arch = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", platform)
if not arch:
    sys.exit(f"--platform {platform}: give a manylinux_2_N_ARCH tag, the target's newest")
glibc, machine = int(arch.group(2)), arch.group(3)
platforms = [f"manylinux_2_{n}_{machine}" for n in range(glibc, 16, -1)]
platforms += [f"manylinux2014_{machine}", f"manylinux2010_{machine}", f"manylinux1_{machine}", f"linux_{machine}"]
env = {"python_version": f"{major}.{minor}", "python_full_version": f"{major}.{minor}.0", "os_name": "posix",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": machine,
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "platform_release": "",
       "platform_version": "", "implementation_version": f"{major}.{minor}.0", "extra": ""}



def pinned(path: str) -> dict:
    """`pip freeze` lines or bare names: name -> version, or None where not given (or not comparable)."""
    out = {}
    with open(path) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if not line or line.startswith("-"):
                continue
            found = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?:==\s*([^\s;]+))?", line)
            name, version = found.group(1), found.group(2)
            try:
                out[canonicalize_name(name)] = Version(version.split("+")[0]) if version else None
            except ValueError:
                out[canonicalize_name(name)] = None
    return out


have = pinned(os.path.join(dest, ".have"))  # what the target holds
os.remove(os.path.join(dest, ".have"))
constraints = {n: SpecifierSet(f"=={v}") for n, v in pinned(constraints_file).items() if v} if constraints_file else {}

with open(os.path.join(root, "pyproject.toml"), "rb") as f:
    roots = [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]
if peer == "1":
    roots.append(Requirement("llmcompressor==0.14.*"))
project = [f for f in os.listdir(dest) if f.startswith("elastic_oneshot-")]


def pip(*args):
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def metadata(path):
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        return email.parser.Parser().parsestr(z.read(name).decode())


def download(wanted: dict, into: str) -> subprocess.CompletedProcess:
    """The newest wheels of `wanted` (name -> spec) for the target, in one pip call (it fails if any has none)."""
    return pip("download", "-q", "--no-deps", "--only-binary=:all:", f"--python-version={major}.{minor}",
               "--implementation=cp", f"--abi=cp{major}{minor}", "--abi=abi3", "--abi=none",
               *[f"--platform={p}" for p in platforms], "-d", into,
               *[f"{n}{s}" for n, s in sorted(wanted.items())])


def fetch(name: str, spec: SpecifierSet) -> str:
    """The newest wheel of `name` within `spec` for the target, into dest; built here from its source archive
    if the registry has no wheel for the target and the package is pure Python."""
    with tempfile.TemporaryDirectory() as tmp:
        got = download({name: spec}, tmp)
        if got.returncode != 0:
            built = pip("wheel", "-q", "--no-deps", f"--no-binary={name}", "-w", tmp, f"{name}{spec}")
            wheels = [w for w in os.listdir(tmp) if w.endswith(".whl")]
            if built.returncode != 0 or not wheels or not wheels[0].endswith("-none-any.whl"):
                sys.exit(f"no wheel of {name}{spec} for cp{major}{minor} {platform}, and none could be built here "
                         f"as pure Python:\n{got.stderr[-1500:]}\n{built.stderr[-1500:]}")
            print(f"  built {wheels[0]} from its source archive", file=sys.stderr)
        wheel = [w for w in os.listdir(tmp) if w.endswith(".whl")][0]
        shutil.move(os.path.join(tmp, wheel), os.path.join(dest, wheel))
        return os.path.join(dest, wheel)


def fetch_all(wanted: dict) -> dict:
    """fetch() of each of `wanted` (name -> spec), in one pip call where every one has a wheel for the target (each
    pip call costs about a second): name -> path."""
    with tempfile.TemporaryDirectory() as tmp:
        if len(wanted) > 1 and download(wanted, tmp).returncode == 0:
            found = {canonicalize_name(w.split("-")[0]): w for w in os.listdir(tmp) if w.endswith(".whl")}
            if found.keys() == wanted.keys():
                for w in found.values():
                    shutil.move(os.path.join(tmp, w), os.path.join(dest, w))
                return {n: os.path.join(dest, w) for n, w in found.items()}
    return {n: fetch(n, spec) for n, spec in wanted.items()}


def requirements(path, extras):
    meta = metadata(path)
    for line in meta.get_all("Requires-Dist") or []:
        r = Requirement(line)
        if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in extras):
            yield r


wheels = {}  # name -> (version, path)
specs = {}  # name -> every specifier asked of it
problems, unchecked = [], set()
queue = [(r, "elastic-oneshot") for r in roots]
expanded = set()  # (name, extra) whose requirements are queued
while queue:  # breadth first, a level at a time: the level's new wheels in one pip call
    level, queue, wanted = queue, [], {}
    taken = []
    for req, parent in level:
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        if name in have:
            if have[name] is not None and not req.specifier.contains(have[name], prereleases=True):
                problems.append(f"{parent} needs {req}, and the target holds {name} {have[name]}")
            elif have[name] is None and req.specifier:
                unchecked.add(f"{parent.split()[0]} needs {name}{req.specifier}")
            continue
        specs[name] = SpecifierSet(",".join(filter(None, [str(specs.get(name, constraints.get(name, ""))),
                                                          str(req.specifier)])))
        if name in wheels and not specs[name].contains(wheels[name][0], prereleases=True):
            os.remove(wheels.pop(name)[1])  # another requirement narrows it: fetch again
            expanded = {e for e in expanded if e[0] != name}
        if name not in wheels:
            wanted[name] = specs[name]
        taken.append((req, name))
    for name, path in fetch_all(wanted).items():
        wheels[name] = (Version(metadata(path)["Version"]), path)
    for req, name in taken:
        for extra in {"", *req.extras}:
            if (name, extra) not in expanded:
                expanded.add((name, extra))
                queue += [(r, f"{name} {wheels[name][0]}") for r in requirements(wheels[name][1], {"", extra})]

# Check the whole set once more from the roots, and drop what no longer follows from them.
reachable, stack = set(), list(roots)
seen = set()
while stack:
    req = stack.pop()
    name = canonicalize_name(req.name)
    if (req.marker is not None and not req.marker.evaluate(env)) or name in have or (name, str(req)) in seen:
        continue
    seen.add((name, str(req)))
    version, path = wheels[name]
    if not req.specifier.contains(version, prereleases=True):
        problems.append(f"{req} is not met by the {name} {version} fetched")
    reachable.add(name)
    stack += list(requirements(path, {"", *req.extras}))
for name in set(wheels) - reachable:
    os.remove(wheels.pop(name)[1])
forbidden = [n for n in wheels if n in ("torch", "triton") or n.startswith("nvidia-") and n != "nvidia-ml-py"]
if forbidden:
    problems.append(f"would bring {', '.join(forbidden)}, which the target's torch environment must provide")
if problems:
    sys.exit("wheelhouse.sh: the set does not fit the target:\n  " + "\n  ".join(problems))

with open(os.path.join(dest, "requirements.txt"), "w") as f:
    f.writelines(f"{n}=={v}\n" for n, (v, _) in sorted(wheels.items()))
size = sum(os.path.getsize(os.path.join(dest, w)) for w in os.listdir(dest) if w.endswith(".whl"))
print(f"{len(wheels) + len(project)} wheels, {size / 2**20:.1f} MiB, in {dest} for cp{major}{minor} {platform}:",
      file=sys.stderr)
for n, (v, p) in sorted(wheels.items()):
    print(f"  {os.path.basename(p):80} {os.path.getsize(p) / 2**20:6.2f} MiB", file=sys.stderr)
for p in project:
    print(f"  {p}", file=sys.stderr)
if unchecked:
    print("not checked (the target's version is not known): " + "; ".join(sorted(unchecked)), file=sys.stderr)
what = ["elastic-oneshot"] if project else ["-r", os.path.join(dest, "requirements.txt")]
if peer == "1":
    what.append(f"llmcompressor=={wheels['llmcompressor'][0]}" if "llmcompressor" in wheels else "'llmcompressor==0.14.*'")
print(f"python3 -m pip install --no-index --find-links {dest} {' '.join(what)}")
PYTHON
if [ "$HAVE" = "$ROOT/launch/gpu-image.txt" ]; then  # for the device tool's machine: carried within 64 MiB
    check_size
fi
