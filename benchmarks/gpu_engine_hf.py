"""transformers `generate()` anchors for benchmarks.gpu_engine, each in its own process (a compile
that runs past its time limit is killed and reported, not waited for):

- eager: the default dynamic cache, `experts_implementation="grouped_mm"` where the installed
  transformers has it (its fastest MoE path; the default loops over experts);
- static: `cache_implementation="static"`, which makes generate() torch.compile the decode step
  (mode reduce-overhead: CUDA graphs), same experts path: transformers' fastest honest setting.
Greedy, exactly NEW tokens after a PROMPT-token prompt, tok/s = batch x NEW / wall time of the
whole generate() call (prefill included), as the engine's end-to-end figure is counted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time


def _child(mode: str, layers: int, batches: list[int], prompt: int, new: int) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from benchmarks.fp8_common import qwen3_30b_a3b_config

    cfg = qwen3_30b_a3b_config(layers)
    kw = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "torch_dtype", "model_type")}
    experts = "grouped_mm"
    try:
        hf_cfg = Qwen3MoeConfig(**kw, experts_implementation=experts)
    except (TypeError, ValueError):
        hf_cfg, experts = Qwen3MoeConfig(**kw), "default"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = Qwen3MoeForCausalLM(hf_cfg).eval()
    torch.set_default_dtype(torch.float32)
    out = {"experts_implementation": experts}
    for b in batches:
        ids = torch.randint(0, cfg.vocab_size, (b, prompt), device="cuda")
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                      do_sample=False, pad_token_id=0)
        if mode == "static":
            kwargs["cache_implementation"] = "static"
        t = time.perf_counter()
        hf.generate(**kwargs)  # warm-up (the compile, for static)
        torch.cuda.synchronize()
        first = time.perf_counter() - t
        times = []
        for _ in range(1):
            t = time.perf_counter()
            hf.generate(**kwargs)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[str(b)] = {"tok_s": b * new / min(times), "first_call_s": first}
        print(json.dumps({"partial": out}), flush=True)
    print(json.dumps({"done": out}), flush=True)


def _run(mode: str, layers: int, batches: list[int], prompt: int, new: int, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.gpu_engine_hf", mode, str(layers), ",".join(map(str, batches)),
           str(prompt), str(new)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        text, err = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        text = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = f"timed out after {timeout:.0f}s"
    last: dict = {}
    for line in text.splitlines():
        if line.startswith("{"):
            msg = json.loads(line)
            last = msg.get("done") or msg.get("partial") or last
            if "done" in msg:
                return last
    last["error"] = (err or "")[-600:]
    return last


def hf_anchors(cfg, batches: list[int], prompt: int, new: int, compile_timeout: float) -> dict:  # noqa: ANN001
    """{batch: {eager_tok_s, static_compile_tok_s, ...}} plus each mode's errors, if any."""
    from benchmarks.fp8_common import log

    res: dict = {}
    for mode, timeout in (("eager", 120.0), ("static", compile_timeout)):
        t = time.perf_counter()
        r = _run(mode, cfg.num_hidden_layers, batches, prompt, new, timeout)
        log(f"transformers {mode}: {r} ({time.perf_counter() - t:.0f}s)")
        for b in batches:
            if str(b) in r:
                res.setdefault(str(b), {})[f"{mode}_tok_s"] = r[str(b)]["tok_s"]
                res[str(b)][f"{mode}_first_call_s"] = r[str(b)]["first_call_s"]
        res[f"{mode}_experts_implementation"] = r.get("experts_implementation")
        if "error" in r:
            res[f"{mode}_error"] = r["error"]
    return res


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), [int(b) for b in sys.argv[3].split(",")], int(sys.argv[4]), int(sys.argv[5]))
