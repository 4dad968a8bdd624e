"""Probe: what vLLM's KV cache and scheduler do with a Mamba hybrid (docs/mamba-on-vllm-cpu.md).

Three parts, each one process, at most one vLLM engine at a time (in-process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the patches and the probe connector
reach it):

- ``hf``: Hugging Face's reference Nemotron-H on the tiny checkpoint
  (harness/tinynemotron.py): does one early token of a 200-token prompt
  change the 8 greedy tokens? Also with the attention layer's output zeroed
  (then only the SSM state carries it). No vLLM.
- ``layout``: a connector-free vLLM instance: ``kv_cache_config`` (groups,
  specs, tensors), the worker's per-layer views (shapes, strides, byte
  offsets in the one flat buffer), the Mamba layers' (conv, ssm) views, the
  block ids the scheduler gives each group (allocate_slots / free patched),
  determinism, context sensitivity, and the state in a request's Mamba block
  after it finished compared with Hugging Face's conv/SSM states.
- ``transfer``: the same instance shape with :class:`MambaProbeConnector`, which
  emulates a P/D transfer inside one engine: a "prefill" request's blocks are
  held at ``request_finished_all_groups`` and copied, group by group, into
  the blocks a "decode" request (same prompt) gets at
  ``update_state_after_alloc``, with the number of external tokens the
  decode reports. Cases: the prefill computes prompt[:-1] or the whole
  prompt; the decode reports N-1 or N tokens; the Mamba state is copied or
  not. Greedy tokens are compared with a plain request.

    taskset -c 1 .venv-vllm/bin/python -m harness.mamba_probe hf|layout|transfer
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")

import torch

from harness.tinynemotron import TinyNemotron, write_tinynemotron

PROMPT_LEN = 200
MAX_TOKENS = 8
# What the patches and the probe connector saw (read through the imported
# module: vLLM's connector factory imports harness.mamba_probe, not __main__).
LOG: list[dict[str, Any]] = []
KV: dict[str, Any] = {}


def emit(**row: Any) -> None:
    print(json.dumps(row, default=str), flush=True)


def prompts(n: int, seed: int = 1, length: int = PROMPT_LEN) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(length)] for _ in range(n)]


def changed_early(prompt: list[int], seed: int) -> list[int]:
    rng = random.Random(seed)
    pos = rng.randrange(0, 20)
    out = list(prompt)
    out[pos] = 3 + (out[pos] - 3 + rng.randrange(1, 509)) % 509
    return out


# ---------------------------------------------------------------- hf


def _transformers() -> Any:
    # transformers lives in .venv-vllm only (import it by name: no stubs here).
    module = importlib.import_module("transformers")
    module.logging.set_verbosity_error()
    return module


def hf_model(folder: Path, noattn: bool = False) -> Any:
    model = (
        _transformers()
        .NemotronHForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        .eval()
    )
    if noattn:
        for layer in model.model.layers:
            if hasattr(layer.mixer, "o_proj"):
                with torch.no_grad():
                    layer.mixer.o_proj.weight.zero_()
    return model


def hf_greedy(model, ids: list[int], n: int = MAX_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(ids) :].tolist()


def hf_states(model, ids: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per Mamba layer: (conv_state, ssm_state) after ``ids``."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    states = {}
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mixer, "A_log"):
            entry = cache.layers[i]
            conv, ssm = entry.conv_states, entry.recurrent_states
            # transformers 5: {0: tensor} per layer; conv [batch, conv_dim, kernel]
            # (the last `kernel` inputs), ssm [batch, heads, head_dim, state].
            conv = conv[0] if isinstance(conv, (list, tuple, dict)) else conv
            ssm = ssm[0] if isinstance(ssm, (list, tuple, dict)) else ssm
            states[i] = (conv.squeeze(0).clone(), ssm.squeeze(0).clone())
    return states


def run_hf(args: argparse.Namespace, folder: Path) -> None:
    for noattn in (False, True):
        model = hf_model(folder, noattn)
        first = anyd = 0
        for k, prompt in enumerate(prompts(args.n, seed=args.seed)):
            a = hf_greedy(model, prompt)
            b = hf_greedy(model, changed_early(prompt, seed=1000 + k))
            first += a[0] != b[0]
            anyd += a != b
        emit(
            part="hf",
            attention_zeroed=noattn,
            prompts=args.n,
            first_token_differs=first,
            any_token_differs=anyd,
        )


# ---------------------------------------------------------------- vLLM helpers


def make_llm(folder: Path, connector: bool):
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if connector:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "MambaProbeConnector",
            "kv_connector_module_path": "harness.mamba_probe",
            "kv_role": "kv_both",
        }
    return LLM(
        model=str(folder),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=False,
        seed=0,
        **kwargs,
    )


def generate(
    llm,
    batch: list[list[int]],
    max_tokens: int = MAX_TOKENS,
    params: list[dict | None] | None = None,
) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = params or [None] * len(batch)
    sps = [
        SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": p} if p else None,
        )
        for p in params
    ]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sps, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def engine_parts(llm):
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    return core.scheduler, runner


def patch_allocation() -> None:
    """Record the flat buffer and the per-layer dict vLLM's worker allocates."""
    from vllm.v1.worker import gpu_model_runner

    original = gpu_model_runner.allocate_kv_cache

    def recording(*a, **kw):
        kv = original(*a, **kw)
        KV["dict"] = kv
        return kv

    gpu_model_runner.allocate_kv_cache = recording


def patch_scheduler() -> None:
    """Log each request's block ids per group after allocate_slots and before free."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    alloc, free = KVCacheManager.allocate_slots, KVCacheManager.free

    def allocate_slots(self, request, num_new_tokens, *a, **kw):
        out = alloc(self, request, num_new_tokens, *a, **kw)
        if out is not None:
            LOG.append(
                {
                    "event": "allocate_slots",
                    "req": request.request_id,
                    "num_new_tokens": num_new_tokens,
                    "num_computed": request.num_computed_tokens,
                    "new": out.get_block_ids(),
                    "all": self.get_block_ids(request.request_id),
                }
            )
        return out

    def free_(self, request):
        LOG.append(
            {
                "event": "free",
                "req": request.request_id,
                "num_computed": request.num_computed_tokens,
                "all": self.get_block_ids(request.request_id),
            }
        )
        return free(self, request)

    KVCacheManager.allocate_slots, KVCacheManager.free = allocate_slots, free_


def describe_config(cfg) -> dict[str, Any]:
    groups = []
    for g, group in enumerate(cfg.kv_cache_groups):
        spec = group.kv_cache_spec
        row = {
            "group": g,
            "spec": type(spec).__name__,
            "block_size": spec.block_size,
            "layers": list(group.layer_names),
            "page_size_bytes": spec.page_size_bytes,
            "enable_kv_transfer": getattr(group, "enable_kv_transfer", None),
        }
        for attr in (
            "shapes",
            "dtypes",
            "page_size_padded",
            "mamba_cache_mode",
            "mamba_type",
            "num_speculative_blocks",
            "real_page_size_bytes",
            "num_kv_heads",
            "head_size",
            "dtype",
            "prefix_cacheable",
        ):
            if hasattr(spec, attr):
                row[attr] = getattr(spec, attr)
        groups.append(row)
    tensors = [
        {
            "size": t.size,
            "layers": list(t.layers),
            "layer_stride": t.layer_stride,
            "block_stride": t.block_stride,
            "offset": t.offset,
        }
        for t in cfg.kv_cache_tensors
    ]
    return {
        "num_blocks": cfg.num_blocks,
        "groups": groups,
        "tensors": tensors,
        "has_mamba_layers": cfg.has_mamba_layers,
        "transfer_group_ids": list(cfg.transfer_group_ids),
    }


def describe_views(runner) -> dict[str, Any]:
    kv = KV["dict"]
    base = min(t.untyped_storage().data_ptr() for t in kv.values())
    views = {}
    for name, t in kv.items():
        views[name] = {
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "dtype": str(t.dtype),
            "byte_offset": t.data_ptr() - base,
            "storage_bytes": t.untyped_storage().nbytes(),
        }
    bound: dict[str, Any] = {}
    for name, layer in runner.compilation_config.static_forward_context.items():
        cache = getattr(layer, "kv_cache", None)
        if isinstance(cache, (tuple, list)):
            bound[name] = [
                {
                    "shape": list(s.shape),
                    "stride": list(s.stride()),
                    "dtype": str(s.dtype),
                    "byte_offset": s.data_ptr() - base,
                }
                for s in cache
            ]
        elif isinstance(cache, torch.Tensor):
            bound[name] = {
                "shape": list(cache.shape),
                "stride": list(cache.stride()),
                "dtype": str(cache.dtype),
                "byte_offset": cache.data_ptr() - base,
            }
    return {
        "dict_views": views,
        "layer_kv_cache": bound,
        "one_storage": len({t.untyped_storage().data_ptr() for t in kv.values()}) == 1,
    }


def mamba_layers(runner) -> dict[str, Any]:
    return {
        name: layer
        for name, layer in runner.compilation_config.static_forward_context.items()
        if isinstance(getattr(layer, "kv_cache", None), (tuple, list))
    }


def _index(name: str) -> int:
    return int(name.split("layers.")[1].split(".")[0])


def compare_states(runner, block: int, ref: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Max |vLLM - HF| of each Mamba layer's conv and SSM state in ``block``."""
    out = {}
    for name, layer in mamba_layers(runner).items():
        conv, ssm = layer.kv_cache[0][block], layer.kv_cache[1][block]
        hconv, hssm = ref[_index(name)]
        # HF keeps the last `kernel` inputs as [dim, kernel]; vLLM the last
        # kernel - 1, as [kernel - 1, dim] (SD layout) or [dim, kernel - 1] (DS).
        hconv = hconv[:, 1:]
        if conv.shape != hconv.shape:
            hconv = hconv.t()
        out[name] = {
            "conv_shape": list(conv.shape),
            "hf_conv_shape": list(hconv.shape),
            "conv_err": float((conv - hconv).abs().max()) if conv.shape == hconv.shape else None,
            "ssm_shape": list(ssm.shape),
            "hf_ssm_shape": list(hssm.shape),
            "ssm_err": float((ssm - hssm.reshape(ssm.shape)).abs().max())
            if ssm.numel() == hssm.numel()
            else None,
            "ssm_norm": float(ssm.norm()),
        }
    return out


# ---------------------------------------------------------------- layout


def run_layout(args: argparse.Namespace, folder: Path) -> None:
    patch_allocation()
    patch_scheduler()
    llm = make_llm(folder, connector=False)
    scheduler, runner = engine_parts(llm)
    cfg = scheduler.kv_cache_config
    emit(
        part="layout",
        config=describe_config(cfg),
        cache_config={
            k: getattr(llm.llm_engine.vllm_config.cache_config, k, None)
            for k in (
                "block_size",
                "mamba_block_size",
                "mamba_cache_mode",
                "mamba_page_size_padded",
                "mamba_ssm_cache_dtype",
                "mamba_cache_dtype",
                "enable_prefix_caching",
            )
        },
    )
    emit(part="layout", **describe_views(runner))
    LOG.clear()
    batch = prompts(args.n, seed=args.seed)
    first = generate(llm, batch)
    again = generate(llm, list(reversed(batch)))[::-1]
    changed = generate(llm, [changed_early(p, 1000 + k) for k, p in enumerate(batch)])
    emit(
        part="layout",
        deterministic=first == again,
        changed_differs=sum(a != b for a, b in zip(first, changed, strict=True)),
        changed_first_token_differs=sum(a[0] != b[0] for a, b in zip(first, changed, strict=True)),
        prompts=len(batch),
    )
    # Block ids over a request's life: one alone, prompt 200, 8 tokens; then
    # the state its Mamba blocks hold, against HF's after the same tokens.
    hf = hf_model(folder)
    for label, tokens, max_tokens in (
        ("full", batch[0], 1),
        ("minus1", batch[0][:-1], 1),
        ("gen8", batch[0], 8),
        ("short", batch[0][:40], 1),
    ):
        LOG.clear()
        out = generate(llm, [tokens], max_tokens)[0]
        events = [e for e in LOG if e["event"] in ("allocate_slots", "free")]
        last = events[-1]["all"]
        seen = list(tokens) + out[:-1]  # what the engine computed (the last sample is never fed)
        states = {}
        for g, group in enumerate(cfg.kv_cache_groups):
            if type(group.kv_cache_spec).__name__ == "MambaSpec":
                states[g] = {
                    str(b): compare_states(runner, b, hf_states(hf, seen))
                    for b in last[g]
                    if b != 0
                }
                states[g]["vs_one_token_less"] = {
                    str(b): compare_states(runner, b, hf_states(hf, seen[:-1]))
                    for b in last[g]
                    if b != 0
                }
        emit(
            part="layout",
            case=label,
            prompt_len=len(tokens),
            max_tokens=max_tokens,
            events=events,
            mamba_block_states=states,
        )


# ---------------------------------------------------------------- transfer


def _connector_base() -> tuple[Any, Any, Any]:
    base = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
    return base.KVConnectorBase_V1, base.KVConnectorMetadata, base.SupportsHMA


def __getattr__(name: str):
    # The connector classes subclass vLLM's and are built on first use, so
    # that `hf` runs without importing vLLM.
    if name == "MambaProbeConnector":
        cls = _build_connector()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def _build_connector() -> Any:
    base: Any
    meta_base: Any
    hma: Any
    base, meta_base, hma = _connector_base()

    class ProbeMetadata(meta_base):
        def __init__(self) -> None:
            self.saves: list[tuple[str, str, tuple[list[int], ...]]] = []
            self.loads: list[tuple[str, str, tuple[list[int], ...], str]] = []

    class Connector(base, hma):
        """Scheduler: hold a 'prefill' request's blocks; worker: copy them into a 'decode' one's."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            self.cfg = kv_cache_config
            self.pending = ProbeMetadata()
            self.saved: dict[str, tuple[list[int], ...]] = {}  # scheduler: key -> P blocks
            self.stash: dict[str, list[list[torch.Tensor]]] = {}  # worker: key -> group -> layer
            self.sent: set[str] = set()
            self.recved: set[str] = set()
            self.kv: dict[str, torch.Tensor] = {}

        # scheduler side
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            p = request.kv_transfer_params or {}
            if not p.get("probe_load"):
                return 0, False
            n = len(request.prompt_token_ids)
            want = n - 1 if p.get("probe_report") == "n-1" else n
            LOG.append(
                {
                    "event": "matched",
                    "req": request.request_id,
                    "num_computed": num_computed_tokens,
                    "report": want - num_computed_tokens,
                }
            )
            return (want - num_computed_tokens, True) if want > num_computed_tokens else (0, False)

        def get_loaded_kv_cache_group_ids(self, request):
            return tuple(self.cfg.transfer_group_ids)

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            p = request.kv_transfer_params or {}
            LOG.append(
                {
                    "event": "after_alloc",
                    "req": request.request_id,
                    "num_external_tokens": num_external_tokens,
                    "num_computed": request.num_computed_tokens,
                    "blocks": blocks.get_block_ids(),
                    "unhashed": blocks.get_unhashed_block_ids_all_groups(),
                }
            )
            if p.get("probe_load") and num_external_tokens > 0 and not p.get("_done"):
                p["_done"] = True
                self.pending.loads.append(
                    (
                        request.request_id,
                        p["probe_load"],
                        blocks.get_block_ids(),
                        p.get("probe_groups", "all"),
                    )
                )

        def build_connector_meta(self, scheduler_output):
            meta, self.pending = self.pending, ProbeMetadata()
            return meta

        def request_finished(self, request, block_ids):
            return False, None

        def request_finished_all_groups(self, request, block_ids):
            p = request.kv_transfer_params or {}
            LOG.append(
                {
                    "event": "finished_all_groups",
                    "req": request.request_id,
                    "num_computed": request.num_computed_tokens,
                    "num_prompt": request.num_prompt_tokens,
                    "block_ids": [list(b) for b in block_ids],
                    "status": str(request.status),
                }
            )
            if p.get("probe_save"):
                self.pending.saves.append(
                    (request.request_id, p["probe_save"], tuple(list(b) for b in block_ids))
                )
                return True, None
            return False, None

        # worker side
        def register_kv_caches(self, kv_caches):
            self.kv = kv_caches

        def start_load_kv(self, forward_context, **kwargs):
            meta = self._get_connector_metadata()
            for req, key, blocks in meta.saves:
                self.stash[key] = [
                    [self.kv[name][ids].clone() for name in group.layer_names] if ids else []
                    for group, ids in zip(
                        self.cfg.kv_cache_groups, [list(g) for g in blocks], strict=True
                    )
                ]
                KV.setdefault("saved_blocks", {})[key] = blocks
                self.sent.add(req)
            for req, key, dblocks, which in meta.loads:
                pblocks = KV["saved_blocks"][key]
                copied = []
                for g, group in enumerate(self.cfg.kv_cache_groups):
                    mamba = type(group.kv_cache_spec).__name__ == "MambaSpec"
                    if mamba and which == "attention":
                        continue
                    src, dst = pblocks[g], dblocks[g]
                    if mamba:
                        pairs = [(len(src) - 1, len(dst) - 1)]  # the state slot: the last
                    else:
                        pairs = [(i, i) for i in range(min(len(src), len(dst)))]
                    for li, name in enumerate(group.layer_names):
                        for si, di in pairs:
                            self.kv[name][dst[di]].copy_(self.stash[key][g][li][si])
                    copied.append((g, [(src[si], dst[di]) for si, di in pairs]))
                KV.setdefault("loads", []).append({"req": req, "key": key, "copied": copied})
                self.recved.add(req)

        def wait_for_layer_load(self, layer_name):
            pass

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            pass

        def wait_for_save(self):
            pass

        def get_finished(self, finished_req_ids):
            sent, self.sent = self.sent, set()
            recved, self.recved = self.recved, set()
            return sent or None, recved or None

    Connector.__name__ = Connector.__qualname__ = "MambaProbeConnector"
    return Connector


CASES = (
    # name, prefill computes, decode reports, groups copied
    ("nixl_way", "n-1", "n-1", "all"),
    ("prefill_n-1_report_n", "n-1", "n", "all"),
    ("prefill_n_report_n", "n", "n", "all"),
    ("prefill_n_report_n-1", "n", "n-1", "all"),
    ("no_mamba_state", "n-1", "n-1", "attention"),
)


def run_transfer(args: argparse.Namespace, folder: Path) -> None:
    from harness import mamba_probe as me

    llm = make_llm(folder, connector=True)
    scheduler, _ = engine_parts(llm)
    emit(part="transfer", config=describe_config(scheduler.kv_cache_config))
    batch = prompts(args.n, seed=args.seed)
    ref = generate(llm, batch)
    for name, prefill, report, groups in CASES:
        equal, details = 0, []
        for k, prompt in enumerate(batch):
            me.LOG.clear()
            key = f"{name}-{k}"
            ptoks = prompt[:-1] if prefill == "n-1" else prompt
            generate(llm, [ptoks], 1, [{"probe_save": key}])
            out = generate(
                llm,
                [prompt],
                MAX_TOKENS,
                [{"probe_load": key, "probe_report": report, "probe_groups": groups}],
            )[0]
            equal += out == ref[k]
            if k < 2:
                details.append(
                    {
                        "tokens": out,
                        "ref": ref[k],
                        "events": [e for e in me.LOG if e["event"] != "allocate_slots"],
                        "copied": me.KV.get("loads", [])[-1:],
                    }
                )
        emit(
            part="transfer",
            case=name,
            prefill_computes=prefill,
            decode_reports=report,
            groups=groups,
            equal_to_single_instance=equal,
            prompts=len(batch),
            detail=details,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("hf", "layout", "transfer"))
    parser.add_argument("--n", type=int, default=8, help="prompts")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tinynemotron-") as tmp:
        folder = write_tinynemotron(Path(tmp), TinyNemotron())
        {"hf": run_hf, "layout": run_layout, "transfer": run_transfer}[args.part](args, folder)


if __name__ == "__main__":
    sys.modules.setdefault("harness.mamba_probe", sys.modules[__name__])
    main()
