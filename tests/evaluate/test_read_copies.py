"""The memory of streamed weights under a lower ``dtype``, measured on both loading paths.

A float32 llama (16 MiB per decoder layer, its largest tensor 4 MiB) is saved, and two of its layers are mapped to
disk (CPU main). Each load runs in its own process with malloc's mmap threshold at 64 KiB, so that memory freed by
a hook goes back to the system and the peak RSS of a forward shows what the hooks hold at once. The streamed peak
(``VmHWM`` after ``clear_refs`` minus the RSS before the forward) must fit what ``allocator.evaluate.validate.check``
predicts for the map (:attr:`allocator.evaluate.memory.Memory.streamed`), and the outputs equal those of the model
loaded in RAM at the same dtype:

- at ``dtype=float32`` both paths hold the largest tensor as stored (4 MiB);
- at ``dtype=float16`` the hook reads the float32 tensor and casts it: the float16 copy and the float32 one live
  together (:func:`allocator.rules.dispatch.read_copy`), 6 MiB, which a rule counting float16 bytes alone (2 MiB)
  misses;
- on accelerate's path the ``.dat`` file is memory-mapped while it is copied: its pages (page cache, reclaimable, as
  for every disk weight not budgeted) add the stored tensor once more to the RSS.

Also: llama's ``rotary_emb.inv_freq`` stays float32 under ``dtype=float16`` on both paths, and the graph counts it so.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import allocator  # noqa: E402
from allocator.evaluate.validate import check  # noqa: E402
from models import assert_same_output  # noqa: E402

MiB = 2**20
DEVICE_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
              "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
              "lm_head": "cpu"}

CHILD = r"""
import json, sys, tempfile, logging
import torch, transformers as tf
from accelerate import init_empty_weights, load_checkpoint_and_dispatch
logging.disable(logging.WARNING)
torch.set_num_threads(1)
loader, path, dtype, device_map = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3]), json.loads(sys.argv[4])
folder = tempfile.mkdtemp()
if loader == "transformers":
    model = tf.LlamaForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map, offload_folder=folder)
else:
    with init_empty_weights():
        model = tf.LlamaForCausalLM(tf.LlamaConfig.from_pretrained(path))
    model.tie_weights()
    model = load_checkpoint_and_dispatch(model, path, device_map=device_map, offload_folder=folder, dtype=dtype)

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

x = torch.randint(0, 100, (1, 4), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    logits = model(x).logits
    model(x)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # reset the high-water mark
    before = status("VmRSS")
    model(x)
    peak = status("VmHWM")
    in_ram = tf.LlamaForCausalLM.from_pretrained(path, dtype=dtype)(x).logits   # the same dtype, no map
print(json.dumps({"streamed": peak - before, "inv_freq": str(model.model.rotary_emb.inv_freq.dtype),
                  "logits": logits.float().tolist(), "in_ram": in_ram.float().tolist()}))
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory, quiet):
    path = tmp_path_factory.mktemp("read_copies") / "llama"
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=8, vocab_size=1000)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config)
    return str(path), meta


@functools.cache
def measure(loader: str, path: str, dtype: str) -> dict:
    """The streamed peak of a forward in a process of its own, and the dtype inv_freq was loaded in."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    done = subprocess.run([sys.executable, "-c", CHILD, loader, path, dtype, json.dumps(DEVICE_MAP)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("loader", ["transformers", "accelerate"])
def test_streamed_peak_fits_what_validate_predicts(saved, loader, dtype):
    path, meta = saved
    problem = allocator.build_problem(meta, {"cpu": 10**12}, dtype=getattr(torch, dtype), loader=loader)
    violations, memory = check(problem, DEVICE_MAP)
    assert not violations
    largest = 512 * 2048 * 4          # the largest tensor as stored (float32 mlp weights)
    kept = largest // 2 if dtype == "float16" else largest
    assert memory.streamed == kept + (largest if dtype == "float16" else 0)   # a cast holds both copies
    found = measure(loader, path, dtype)
    got, in_ram = (torch.tensor(found[k]).to(getattr(torch, dtype)) for k in ("logits", "in_ram"))
    assert_same_output(got, in_ram, msg="the offloaded model computes what the model in RAM computes at that dtype")
    measured = found["streamed"]
    mapped = largest if loader == "accelerate" else 0   # the .dat file's pages while it is copied (page cache)
    assert measured <= memory.streamed + mapped + MiB // 2, (measured / MiB, memory.streamed / MiB)
    if dtype == "float16":   # the copy is real: counting float16 bytes alone would be short
        assert measured > kept + mapped + MiB, (measured / MiB, kept / MiB)


@pytest.mark.subprocess
def test_inv_freq_keeps_float32_under_float16(saved):
    path, meta = saved
    graph = allocator.build_problem(meta, {"cpu": 10**12}, dtype=torch.float16).graph
    k = graph.tensor_index["model.rotary_emb.inv_freq"]
    assert graph.tensors.nbytes[k] == meta.model.rotary_emb.inv_freq.numel() * 4
    assert k not in graph.stored      # not in the checkpoint: nothing reads or casts it
    assert measure("transformers", path, "float16")["inv_freq"] == "torch.float32"
