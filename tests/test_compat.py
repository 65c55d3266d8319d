"""The ``fairscale`` alias (fairscale_c.compat), process-group stand-ins at world 1, and a script
written only against FairScale's public API run unchanged under ``python -m fairscale_c.compat``.

The alias changes sys.modules, so each case runs in a fresh interpreter."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import fairscale_c.distributed as fdist
from fairscale_c.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale_c.optim.grad_scaler import ShardedGradScaler

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, *(["-c", textwrap.dedent(code)] if code else []), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=HERE,
    )


def check(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


PUBLIC_MODULES = [
    "fairscale",
    "fairscale.nn",
    "fairscale.nn.data_parallel",
    "fairscale.nn.checkpoint",
    "fairscale.nn.checkpoint.checkpoint_activations",
    "fairscale.nn.wrap",
    "fairscale.nn.misc",
    "fairscale.nn.misc.param_bucket",
    "fairscale.nn.moe",
    "fairscale.nn.moe.moe_layer",
    "fairscale.nn.moe.top2gate",
    "fairscale.nn.model_parallel",
    "fairscale.nn.model_parallel.layers",
    "fairscale.nn.model_parallel.initialize",
    "fairscale.nn.model_parallel.mappings",
    "fairscale.nn.model_parallel.cross_entropy",
    "fairscale.nn.model_parallel.random",
    "fairscale.nn.model_parallel.utils",
    "fairscale.internal",
    "fairscale.internal.parallel",
    "fairscale.internal.containers",
    "fairscale.internal.params",
    "fairscale.internal.state_dict",
    "fairscale.internal.object",
    "fairscale.internal.version",
    "fairscale.internal.reduce_scatter_bucketer",
    "fairscale.optim",
    "fairscale.optim.grad_scaler",
    "fairscale.optim.layerwise_gradient_scaler",
    "fairscale.optim.adam",
    "fairscale.experimental.nn.mevo",
    "fairscale.experimental.nn.offload",
    "fairscale.version",
    "fairscale.nn.pipe.types",
    "fairscale.nn.pipe.async_pipe",
    "fairscale.experimental.nn.ampnet_pipe",
    "fairscale.experimental.nn.ampnet_pipe.pipe",
    "fairscale.experimental.nn.ampnet_pipe.ampnet",
    "fairscale.experimental.nn.distributed_pipeline",
    "fairscale.experimental.nn.distributed_pipeline.graph",
    "fairscale.experimental.nn.distributed_pipeline.pipeline",
    "fairscale.experimental.nn.distributed_pipeline.loss",
    "fairscale.experimental.nn.distributed_pipeline.data",
    "fairscale.experimental.nn.distributed_pipeline.trace",
    "fairscale.nn.pipe",
    "fairscale.nn.pipe.skip",
    "fairscale.nn.pipe.balance",
    "fairscale.optim.oss",
    "fairscale.optim.adascale",
    "fairscale.nn.data_parallel.sharded_ddp",
    "fairscale.experimental.nn.data_parallel",
    "fairscale.experimental.nn.data_parallel.gossip",
    "fairscale.experimental.nn.data_parallel.gossip.distributed",
    "fairscale.experimental.nn.data_parallel.gossip.gossiper",
    "fairscale.experimental.nn.data_parallel.gossip.graph_manager",
    "fairscale.experimental.nn.data_parallel.gossip.mixing_manager",
    "fairscale.experimental.nn.data_parallel.gossip.utils",
    "fairscale.experimental.nn.data_parallel.gossip.utils.helpers",
    "fairscale.experimental.nn.data_parallel.gossip.utils.cuda_metering",
    "fairscale.experimental.tooling",
    "fairscale.experimental.tooling.layer_memory_tracker",
]


def test_alias_gives_the_same_module_objects():
    out = check(
        run_python(f"""
        import importlib, sys
        import fairscale_c.compat
        fairscale_c.compat.install()
        fairscale_c.compat.install()  # idempotent
        for name in {PUBLIC_MODULES!r}:
            mod = importlib.import_module(name)
            own = "fairscale_c" + name[len("fairscale"):]
            if name != "fairscale":
                assert mod is importlib.import_module(own), name
                assert sys.modules[name] is sys.modules[own], name
                assert mod.__spec__.name == own, (name, mod.__spec__.name)  # its own spec is kept
        import fairscale
        import fairscale_c.nn, fairscale_c.optim.grad_scaler
        from fairscale.nn.data_parallel import FullyShardedDataParallel
        from fairscale.nn import FullyShardedDataParallel as F2, checkpoint_wrapper, auto_wrap, enable_wrap, wrap
        from fairscale.nn.checkpoint.checkpoint_activations import disable_checkpointing
        from fairscale.optim.grad_scaler import ShardedGradScaler
        assert FullyShardedDataParallel is F2 is fairscale_c.nn.FullyShardedDataParallel
        assert ShardedGradScaler is fairscale_c.optim.grad_scaler.ShardedGradScaler
        assert fairscale.nn is fairscale_c.nn and fairscale.optim is fairscale_c.optim
        assert fairscale.DistributedError is fairscale_c.DistributedError
        from fairscale.version import __version_tuple__
        from fairscale.nn.pipe import LazyModule, Pipe
        assert LazyModule(lambda: fairscale.nn.Pipe)() is Pipe
        assert __version_tuple__ == fairscale.__version_tuple__ == (0, 4, 13)
        print(fairscale.__version__, fairscale.__version_tuple__)
        fairscale_c.compat.uninstall()
        assert "fairscale" not in sys.modules and "fairscale.nn" not in sys.modules
        assert sys.modules["fairscale_c.nn"] is fairscale_c.nn
        try:
            import fairscale
        except ImportError:
            print("gone")
        else:  # the real FairScale, installed next to us: what `import fairscale` finds without the alias
            assert not fairscale.__version__.endswith("fairscale_c.0.1.0"), fairscale.__version__
            assert "fairscale_c" not in fairscale.__file__, fairscale.__file__
            print("gone")
        """)
    )
    assert out.split() == ["0.4.13+fairscale_c.0.1.0", "(0,", "4,", "13)", "gone"]


@pytest.mark.parametrize("name", ["fairscale.fair_dev", "fairscale.nn.pipe.async_schedule"])
def test_alias_names_a_module_it_does_not_provide(name):
    proc = run_python(f"""
        import importlib, fairscale_c.compat
        fairscale_c.compat.install()
        importlib.import_module({name!r})
        """)
    assert proc.returncode != 0
    assert f"ModuleNotFoundError: {name} is not provided by fairscale_c" in proc.stderr, proc.stderr


def test_alias_names_a_missing_class():
    proc = run_python("""
        import fairscale_c.compat
        fairscale_c.compat.install()
        from fairscale.nn.pipe.types import PipeMessage
        """)
    assert proc.returncode != 0, proc.stderr
    assert "cannot import name 'PipeMessage' from 'fairscale_c.nn.pipe.types'" in proc.stderr, proc.stderr


def test_messages_name_packages_as_the_caller_imports_them():
    """Pipe's missing-balance error points to the balance helpers under the name in use."""
    out = check(
        run_python("""
        import torch.nn as nn
        import fairscale_c.compat
        from fairscale_c.nn import Pipe
        for alias in (False, True):
            if alias:
                fairscale_c.compat.install()
            try:
                Pipe(nn.Sequential(nn.Linear(1, 1)))
            except ValueError as exc:
                print([line for line in str(exc).splitlines() if line.strip().startswith("from ")][0].split()[1])
        """)
    )
    assert out.split() == ["fairscale_c.nn.pipe.balance", "fairscale.nn.pipe.balance"]


def test_alias_refuses_when_the_real_fairscale_is_loaded(tmp_path):
    # A stand-in for an installed FairScale: a package named fairscale on sys.path.
    pkg = tmp_path / "fairscale"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__version__ = '0.4.13'\n")
    proc = run_python(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import fairscale
        import fairscale_c.compat
        try:
            fairscale_c.compat.install()
        except RuntimeError as exc:
            print(exc)
        assert sys.modules["fairscale"] is fairscale and not fairscale_c.compat.is_installed()
        """)
    out = check(proc)
    assert "the real FairScale package is already imported (fairscale from " in out
    assert str(pkg / "__init__.py") in out


def test_alias_shadows_an_installed_but_unimported_fairscale(tmp_path):
    pkg = tmp_path / "fairscale"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('the real fairscale was imported')\n")
    out = check(
        run_python(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import fairscale_c.compat
        fairscale_c.compat.install()
        import fairscale.nn, fairscale_c.nn
        print(fairscale.nn is fairscale_c.nn)
        """)
    )
    assert out.strip() == "True"


def test_alias_reaches_child_processes(tmp_path):
    # A spawned worker runs none of the __main__ code that installed the alias (Tango's workers
    # import tango.integrations.fairscale to find the "fairscale" engine): it must have the alias
    # all the same, and an installed FairScale (the stand-in below) must not be what it gets.
    pkg = tmp_path / "fairscale"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('the real fairscale was imported')\n")
    (tmp_path / "probe.py").write_text(
        "def probe():\n"
        "    import fairscale.nn, fairscale_c.compat, fairscale_c.nn\n"
        "    return fairscale.__version__, fairscale.nn is fairscale_c.nn, fairscale_c.compat.is_installed()\n"
    )
    out = check(
        run_python(f"""
        import multiprocessing, os, subprocess, sys
        sys.path.append({str(tmp_path)!r})
        os.environ["PYTHONPATH"] = {str(tmp_path)!r}
        import fairscale_c.compat as compat
        compat.install()
        import probe
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            print(pool.apply_async(probe.probe).get(timeout=60))  # a worker that dies loses the task
        code = "import fairscale.nn, fairscale_c.nn; print(fairscale.__version__, fairscale.nn is fairscale_c.nn)"
        print(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip())
        compat.uninstall()
        print(os.environ["PYTHONPATH"] == {str(tmp_path)!r}, compat.SHIM_DIR not in sys.path)
        """)
    )
    assert out.splitlines() == [
        "('0.4.13+fairscale_c.0.1.0', True, True)",
        "0.4.13+fairscale_c.0.1.0 True",
        "True True",
    ], out


def test_module_runner_passes_arguments_and_main(tmp_path):
    script = tmp_path / "tool.py"
    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    script.write_text(
        "import sys, fairscale, helper\n"
        "from fairscale.nn.data_parallel import FullyShardedDataParallel\n"
        "if __name__ == '__main__':\n"
        "    print(FullyShardedDataParallel.__module__, sys.argv[1:], sys.argv[0].endswith('tool.py'), helper.VALUE)\n"
    )
    out = check(run_python("", "-m", "fairscale_c.compat", str(script), "--steps", "3"))
    assert out.split() == [
        "fairscale_c.nn.data_parallel.fully_sharded_data_parallel",
        "['--steps',",
        "'3']",
        "True",
        "7",
    ]
    proc = run_python("", "-m", "fairscale_c.compat", str(tmp_path / "missing.py"))
    assert proc.returncode == 2 and "no such script" in proc.stderr
    proc = run_python("", "-m", "fairscale_c.compat")
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_subpackages_are_attributes_after_importing_the_package():
    """``import fairscale; fairscale.nn.FullyShardedDataParallel`` works in FairScale (its
    ``__init__`` imports ``nn``): after the import rename, and under the alias, too."""
    proc = run_python(
        """
        import sys
        import fairscale_c
        assert "torch" not in sys.modules  # the package alone stays light: subpackages load on use
        assert fairscale_c.nn.FullyShardedDataParallel.__name__ == "FullyShardedDataParallel"
        assert fairscale_c.optim.OSS.__name__ == "OSS"
        assert fairscale_c.nn.model_parallel.layers.ColumnParallelLinear.__name__ == "ColumnParallelLinear"
        assert fairscale_c.internal.parallel.ProcessGroupName.__name__ == "ProcessGroupName"
        assert fairscale_c.version.__version_tuple__ == (0, 4, 13)
        try:
            fairscale_c.no_such_thing
        except AttributeError as exc:
            assert "no attribute 'no_such_thing'" in str(exc)
        else:
            raise AssertionError("no AttributeError")
        import fairscale_c.compat
        fairscale_c.compat.install()
        import fairscale
        assert fairscale.nn.model_parallel.initialize is fairscale_c.nn.model_parallel.initialize
        assert fairscale.internal.params is fairscale_c.internal.params
        print("ok")
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_fairscale_only_script_runs_unchanged():
    """Two ranks, each started as torchrun would (environment variables), each running the script
    under the alias; every rank checks its losses and the final full weights against PyTorch."""
    from dist_utils import free_port

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), FAIRSCALE_C_TIMEOUT="60")
    cmd = [sys.executable, "-m", "fairscale_c.compat", os.path.join(HERE, "fairscale_script.py"), "--steps", "4"]
    procs = [
        subprocess.Popen(
            cmd, env=dict(env, RANK=str(r)), cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for r in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out}"
        assert f"rank {r}/2: fairscale 0.4.13+fairscale_c" in out and "fsdp: 4 steps match plain PyTorch" in out, out
        assert "fairscale script: ok" in out, out


# ------------------------------------------------------------ process-group stand-ins at world 1


class StandIn:
    """What FairScale's own tests pass as a process group: an object with rank() and size()."""

    def __init__(self, rank: int = 0, size: int = 1):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_stand_in_group_at_world_one_needs_no_torch_distributed():
    assert not torch.distributed.is_initialized()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    module.load_state_dict(ref.state_dict())
    pg = StandIn()
    model = FSDP(module, process_group=pg, process_group_reduce_scatter=StandIn())
    assert model.process_group is pg and model.world_size == 1 and model.rank == 0
    x = torch.randn(5, 4)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(model.flat_param_0.grad, torch.cat([p.grad.reshape(-1) for p in ref.parameters()]))
    scaler = ShardedGradScaler(process_group=pg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.flat_param_0.detach().clone()
    opt.zero_grad()
    scaler.scale(model(x).square().sum()).backward()
    scaler.step(opt)  # unscales: the step is the plain SGD step
    scaler.update()
    torch.testing.assert_close(model.flat_param_0.detach(), before - 0.1 * model.flat_param_0.grad)
    assert scaler.get_scale() == 2.0**16  # no inf found, no growth yet
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    "pg, exc, match",
    [
        (
            StandIn(0, 2),
            ValueError,
            r"argument 'process_group' \(StandIn\) is not a torch.distributed process group and has size 2",
        ),
        (StandIn(1, 1), ValueError, r"argument 'process_group' \(StandIn\) reports rank\(\)=1, size\(\)=1"),
        (
            object(),
            TypeError,
            r"'process_group' must be a process group, an object with rank\(\) and size\(\), or None",
        ),
    ],
)
def test_stand_in_group_bad_input(pg, exc, match):
    with pytest.raises(exc, match=match):
        FSDP(nn.Linear(2, 2), process_group=pg)
    with pytest.raises((TypeError, ValueError)):
        fdist.group_for(pg)
    if isinstance(pg, StandIn):  # each feature names its own argument
        from fairscale_c.optim import OSS

        with pytest.raises(exc, match=match.replace("'process_group'", "'group'")):
            OSS(nn.Linear(2, 2).parameters(), lr=0.1, group=pg)


def test_alias_serves_wgit():
    out = check(
        run_python("""
        import fairscale_c.compat
        fairscale_c.compat.install()
        from fairscale.experimental.wgit import Repo, SignalSparsity
        from fairscale.experimental.wgit.sha1_store import SHA1_Store
        import fairscale_c.experimental.wgit as w
        print(Repo is w.Repo, SignalSparsity is w.SignalSparsity, SHA1_Store.__module__)
        """)
    )
    assert out.split() == ["True", "True", "fairscale_c.experimental.wgit.sha1_store"]
