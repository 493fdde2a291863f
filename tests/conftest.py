"""Fixtures the test modules share; shared helpers live in elastic_oneshot/testing (runs.py, tiny.py, ...)."""

import compileall
import gc
import os
import signal

import pytest
import torch

from elastic_oneshot.testing.tiny import make_model
from launch.chaos import Cluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# etcd3's generated code loads only with protobuf's pure-Python runtime, chosen at protobuf's first import: set it
# before any test module imports etcd3 (as elastic_oneshot.distributed.etcd_client does for the product).
os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")

# Under pytest-xdist (the README's `-n 2`), each worker's torch and the processes its tests start default to one
# thread: two OpenMP teams of two on 2 cores spin against each other. Tests that need a thread count set their own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _signal_mask():
    """The CLI's main() blocks SIGTERM for its sigwait thread; called in-process, it would leave pytest's mask so
    and every later subprocess (a torchrun agent told to stop, say) would inherit a blocked SIGTERM."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@pytest.fixture(scope="module")
def table(request):
    """A module's table of figures, one row per test that ran, printed after its last test whatever the order."""
    rows: list[str] = []
    yield rows
    if rows:
        with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
            print("\n" + "\n".join(sorted(rows)))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("models") / "llama"), "llama")


def pytest_configure(config):
    """This checkout's modules compiled once for the hundreds of processes the suite starts (where
    PYTHONDONTWRITEBYTECODE is set, as on this project's machines, each would compile them again); the modules handed
    out in LONGEST_FIRST's order."""
    if hasattr(config.option, "loadscopereorder"):  # xdist's --no-loadscope-reorder, where this xdist has it
        config.option.loadscopereorder = False
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        for package in ("elastic_oneshot", "launch"):
            compileall.compile_dir(os.path.join(ROOT, package), quiet=1)


# The modules that take longest, longest first. Under `-n 2 --dist loadfile` a worker takes the next module when it is
# free: started first, these end before the short ones, and neither worker is left running a long module alone at the
# end. (pytest-xdist >= 3.6 would order modules by their number of tests instead: pytest_configure turns that off.)
LONGEST_FIRST = ("test_network.py", "test_recipe_parity.py", "test_elastic.py", "test_object_store.py",
                 "test_etcd_records.py", "test_recipe_resume.py", "test_distributed.py", "test_wheelhouse.py",
                 "test_architectures.py", "test_gpu_session.py", "test_reach.py", "test_failures.py")


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, llmcompressor, the test modules) frozen out of the cyclic
    collector's later passes, which would otherwise traverse it all again in every in-process run of the peer."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """The longest modules first (LONGEST_FIRST), the others after them as collected. `cuda` tests run only where
    a CUDA device is (ELASTIC_ONESHOT_TEST_DEVICE=cpu runs them on the CPU)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module's order is kept
    if torch.cuda.is_available() or os.environ.get("ELASTIC_ONESHOT_TEST_DEVICE"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def clusters():
    """Clusters made in a test, closed (every node and the store killed) whatever happens."""
    made = []

    def make(*args, **kwargs):
        made.append(Cluster(*args, **kwargs))
        return made[-1]
    yield make
    for cluster in made:
        cluster.close()
