"""Memory that comes back (issue 48): after a patched load (``runtime="allocator"``), ``generate``, ``detach``,
``del model`` and ``gc.collect()``, the process's anonymous RSS ends where it was before the load, measured in a
fresh process; and what :func:`allocator.offload.detach` lets go of, checked on the runtime object itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

#: a fresh process: a Qwen3-MoE shape of ~100 MiB saved, everything imported and warmed once (a load in RAM and
#: generate, a plan, patch() entered: one-time imports and kernels are not what a load holds), the heap trimmed,
#: then two patched loads at 30 % RAM: generate, detach, del, gc; the second keeps the runtime object.
SCRIPT = r"""
import ctypes, gc, json, sys, tempfile
from pathlib import Path
import torch
torch.set_num_threads(1)
import allocator
from allocator import offload
from transformers import AutoConfig, AutoModelForCausalLM

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

config = AutoConfig.for_model("qwen3_moe", vocab_size=512, max_position_embeddings=128, hidden_size=256,
                              intermediate_size=512, moe_intermediate_size=64, num_experts=64, num_experts_per_tok=4,
                              num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                              decoder_sparse_step=1, mlp_only_layers=[])
folder = Path(tempfile.mkdtemp()) / "m"
torch.manual_seed(0)
AutoModelForCausalLM.from_config(config).save_pretrained(folder)
with torch.device("meta"):
    meta = AutoModelForCausalLM.from_config(config)
budget = {"cpu": int(0.3 * allocator.build_problem(meta, {"cpu": 0}).graph.total)}
prompt = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(1))
load = lambda **kw: AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager", **kw).eval()
model = load()
model.generate(prompt, max_new_tokens=3, do_sample=False)
allocator.plan(meta, budget, runtime="allocator")
with allocator.patch(runtime="allocator"):
    pass
del model, meta
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
out = []
for keep_runtime in (False, True):
    before = anon()
    with allocator.patch(runtime="allocator"):
        model = load(device_map="auto", max_memory=budget, offload_folder=str(folder.parent / "off"))
    runtime = offload.runtime_of(model)
    assert runtime is not None and runtime.experts
    model.generate(prompt, max_new_tokens=3, do_sample=False)
    loaded = anon()
    offload.detach(model)
    del model
    if not keep_runtime:
        del runtime
    gc.collect()
    out.append({"keep_runtime": keep_runtime, "before": before, "loaded": loaded, "after": anon()})
print(json.dumps(out))
"""


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or not Path("/proc/self/status").exists(),
                    reason="anonymous RSS is read from Linux's /proc/self/status")
def test_anonymous_rss_comes_back_after_detach_and_del():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    for cycle in json.loads(proc.stdout.strip().splitlines()[-1]):
        mib = {k: v / 2 ** 20 for k, v in cycle.items() if k != "keep_runtime"}
        assert mib["loaded"] - mib["before"] > 10, cycle   # the load did hold memory: the check below can fail
        assert mib["after"] - mib["before"] <= 10, (
            f"{mib['after'] - mib['before']:.1f} MiB of anonymous memory stayed after detach, del and gc "
            f"(keep_runtime={cycle['keep_runtime']}): {mib}")


def test_detach_lets_go_of_what_the_runtime_held(tmp_path):
    """The runtime object outlives ``detach`` without keeping the model, its mapped files or expert copies."""
    from transformers import AutoModelForCausalLM

    import allocator
    from allocator.errors import InvalidRuntime
    from allocator.offload import attach, detach
    from moe_models import small_model

    ref = small_model("qwen3_moe", layers=4)
    ref.save_pretrained(tmp_path / "m")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(ref.config)
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    plan = allocator.plan(meta, {"cpu": int(total * 0.6)}, runtime="allocator")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=plan.device_map,
                                                 offload_folder=tmp_path / "off", experts_implementation="eager")
    runtime = attach(model, plan, device="stand-in")   # resident experts copied: RoutedExperts.resident
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 6)))
    files = list(runtime.files.open.values())
    assert files and any(r.resident for r in runtime.experts.values())
    state = runtime.state
    detach(model)
    assert runtime.files.open == {} and all(f.closed and f.mm is None for f in files)
    assert not any(r.resident or r.remote_tensors for r in runtime.experts.values())
    assert runtime.model is None and all(u.module is None and not u.slots for u in runtime.units)
    assert runtime.fetch_buffers.nbytes() == 0 and runtime.state == state and runtime.traffic.calls > 0
    with pytest.raises(InvalidRuntime, match="detached"):
        files[0].view(0, 4, torch.float32, (1,))
