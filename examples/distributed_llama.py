"""A tiny llama over two processes on CPU (gloo), from allocator's discovered blocks.

    torchrun --nproc_per_node 2 examples/distributed_llama.py --mode fsdp       # FSDP2: apply_fully_shard
    torchrun --nproc_per_node 2 examples/distributed_llama.py --mode fsdp1      # FSDP1: fsdp_wrap_policy
    torchrun --nproc_per_node 2 examples/distributed_llama.py --mode pipeline   # pipeline_split_spec + GPipe

The model is built from a config (nothing is downloaded). ``fsdp`` and ``fsdp1`` train a few SGD steps, each rank
on its own batch, and print the loss; ``pipeline`` splits the llama into one stage per rank, runs a batch through
the pipeline in microbatches and compares the logits with the whole model run in one process.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from allocator.parallel import apply_fully_shard, fsdp_wrap_policy, pipeline_split_spec

CONFIG = LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=128, use_cache=False,  # no KV cache: a pipeline can trace the model
)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same weights on every rank
    return LlamaForCausalLM(CONFIG)


def batch(size: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (size, length), generator=torch.Generator().manual_seed(seed))


def train(model: torch.nn.Module, steps: int) -> None:
    rank = dist.get_rank()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        ids = batch(4, 32, seed=1000 * step + rank)  # data parallel: each rank its own batch
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} (rank 0's batch)")


def run_fsdp(steps: int) -> None:
    model = apply_fully_shard(tiny_llama())  # fully_shard on each LlamaDecoderLayer, then on the root
    if dist.get_rank() == 0:
        weight = model.model.layers[0].mlp.up_proj.weight
        print(f"FSDP2: layer 0 up_proj {tuple(weight.shape)} held as {tuple(weight.to_local().shape)} per rank")
    train(model, steps)


def run_fsdp1(steps: int) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = tiny_llama()
    model = FullyShardedDataParallel(
        model, auto_wrap_policy=fsdp_wrap_policy(model), device_id=torch.device("cpu"), use_orig_params=True
    )
    if dist.get_rank() == 0:
        units = sum(isinstance(m, FullyShardedDataParallel) for m in model.modules())
        print(f"FSDP1: {units} FSDP units (one per decoder layer, one at the root)")
    train(model, steps)


def run_pipeline(microbatches: int) -> None:
    from torch.distributed.pipelining import ScheduleGPipe, build_stage, pipeline

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_llama().eval()
    split = pipeline_split_spec(model, world)
    if rank == 0:
        print(split.explain())
    ids = batch(2 * microbatches, 32, seed=0)
    pipe = pipeline(copy.deepcopy(model), mb_args=(ids.chunk(microbatches)[0],), split_spec=split.split_spec)
    stage = build_stage(pipe.get_stage_module(rank), rank, pipe.info(), torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=microbatches)
    with torch.no_grad():
        logits = schedule.step(ids) if rank == 0 else schedule.step()
        if rank == world - 1:
            expected = torch.cat([model(input_ids=chunk).logits for chunk in ids.chunk(microbatches)])
            print(f"pipeline logits {tuple(logits.shape)}; max |pipeline - one process| = "
                  f"{(logits - expected).abs().max().item():.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("fsdp", "fsdp1", "pipeline"), required=True)
    parser.add_argument("--steps", type=int, default=3, help="SGD steps (fsdp, fsdp1)")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per batch (pipeline)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
    dist.init_process_group("gloo")  # rank, world size and rendezvous from torchrun's environment
    try:
        {"fsdp": lambda: run_fsdp(args.steps), "fsdp1": lambda: run_fsdp1(args.steps),
         "pipeline": lambda: run_pipeline(args.microbatches)}[args.mode]()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
