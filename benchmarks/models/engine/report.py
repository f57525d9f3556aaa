"""The report: the run's results as markdown tables, one renderer per section."""

from __future__ import annotations

from .base import _ratio


def _f(x, nd=1, unit=""):
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int,)) and not isinstance(x, bool):
        return f"{x}{unit}"
    return f"{x:.{nd}f}{unit}"


def _ms(s):
    return "n/a" if s is None else f"{s * 1e3:.1f}"


def _met(t: dict) -> str:
    if t.get("met") is None:
        return "n/a"
    return "**met**" if t["met"] else "**not met**"


def _target_row(sec: str, t: dict) -> str:
    note = f" ({t['note']})" if t.get("note") else ""
    op = t.get("op", ">=")
    unit = t.get("unit", "x")
    if op == "<=abs":
        tgt, got = f"within +-{100 * t['target']:g}%", _f(None if t["measured"] is None else 100 * t["measured"], 2, "%")
    else:
        tgt, got = f"{op} {t['target']:g}{unit}", _f(t["measured"], 2, unit)
    return f"| {sec} | {t['metric']}{note} | {tgt} | {got} | {_met(t)} |"


def _render_multiturn(L: list, R: dict, key: str, title: str) -> None:
    mt = R.get(key)
    L.append(title + "\n")
    if mt:
        L.append(f"User turns: {mt['user_turns_from']}; greedy replies, max_tokens={mt['reply_max_tokens']}. "
                 "kvkeeper: one Session with KV reuse. No-reuse: the same prompt ids in an isolated namespace. "
                 "transformers: the same prompt ids re-prefilled from scratch, `generate(max_new_tokens=1)`, "
                 "timed once after one warm-up on the same ids. llama.cpp: the same ids through "
                 "`create_completion(max_tokens=1)` on one context that keeps the conversation (its prefix reuse), "
                 "extended by each reply untimed (" + mt["llama_cpp"] + ").\n")
        has_llama = any(r.get("llama_cpp_ttft_s") is not None for r in mt["turns"])
        hdr = ("| turn | history tokens | cached | new | kvkeeper TTFT ms | no-reuse TTFT ms | transformers TTFT ms "
               "| transformers / kvkeeper | no-reuse / kvkeeper |")
        sep = "|---|---|---|---|---|---|---|---|---|"
        if has_llama:
            hdr += " llama.cpp TTFT ms | kvkeeper / llama.cpp |"
            sep += "---|---|"
        hdr += " first token agrees |"
        sep += "---|"
        L += [hdr, sep]
        for r in mt["turns"]:
            line = (f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['new_tokens']} | "
                    f"{_ms(r['kvkeeper_ttft_s'])} | {_ms(r.get('noreuse_ttft_s'))} | {_ms(r.get('transformers_ttft_s'))} | "
                    f"{_f(r['ratio_transformers_over_kvkeeper'], 1, 'x')} | {_f(r['ratio_noreuse_over_kvkeeper'], 1, 'x')} |")
            if has_llama:
                line += (f" {_ms(r.get('llama_cpp_ttft_s'))} | "
                         f"{_f(_ratio(r['kvkeeper_ttft_s'], r.get('llama_cpp_ttft_s')), 2, 'x')} |")
            line += f" {_f(r['first_token_agrees'])} |"
            L.append(line)
        L.append("")
        for tk in ("target", "target_llama_cpp"):
            t = mt.get(tk)
            if t and (tk != "target" or key == "multiturn"):
                L.append(f"Target: {_target_row(title.split(' ', 2)[-1], t)}")
        L.append("\nkvkeeper TTFT runs from queueing the request to its first sampled token; the chat-template "
                 "rendering and tokenisation before it are not counted (the peers get pre-tokenised ids too). "
                 "'first token agrees' compares kvkeeper (reuse), kvkeeper (no reuse) and transformers (float32): "
                 "with a quantized weight format a differing first token against float32 is a rounding effect.")
    else:
        L.append(f"failed: {(R.get('errors') or {}).get(key)}")
    L.append("")


def _render_header(L: list, R: dict) -> None:
    """The title and the table of the machine, the model and the peers; a warning when the machine was busy."""
    m = R["machine"]
    L.append(f"# kvkeeper engine benchmark{' (QUICK smoke run: numbers not meaningful)' if R['quick'] else ''}\n")
    L.append("| item | value |\n|---|---|")
    for k in ("date", "cpu_model", "os_cpu_count", "sched_cpus", "torch_threads", "torch_version", "torch_blas",
              "transformers_version", "python", "loadavg_start", "loadavg_end"):
        v = m.get(k)
        if isinstance(v, (list, tuple)):
            v = ", ".join(f"{x:.2f}" for x in v)
        L.append(f"| {k} | {v} |")
    L.append(f"| model | {R['model']['path']} (same file for every engine) |")
    L.append(f"| kvkeeper weights (sections 2-6) | {R['model'].get('weights')}; attention backend "
             f"{R['model'].get('attention_backend')}; fused decode step {_f(R['model'].get('fused_decode'))}; "
             f"C++ kernels' ISA {R.get('kernels_isa')} |")
    L.append(f"| llama.cpp | {R.get('llama_cpp')} |")
    L.append(f"| transformers load time | {_f(R['model'].get('transformers_load_s'), 1, ' s')} |")
    L.append("")
    busy = [x for x in (m.get("loadavg_start"), m.get("loadavg_end")) if x]
    ncpu = m.get("sched_cpus") or m.get("os_cpu_count") or 1
    if any(x[0] > 0.75 * ncpu for x in busy):
        L.append(f"> **Warning: the machine was busy** (1-min load average {', '.join(f'{x[0]:.1f}' for x in busy)} "
                 f"on {ncpu} CPUs). With more runnable threads than cores, multi-threaded (OpenMP) matmuls stall "
                 "on descheduled threads, so every number below is unreliable; rerun on a quiet machine.\n")


def _render_targets(L: list, R: dict) -> None:
    """Every target next to its measured ratio, one row per target of each section."""
    L.append("## Targets\n")
    L.append("| section | metric | target | measured | status |\n|---|---|---|---|---|")
    for sec, key, tkeys in (("0. weight formats", "formats", ("target_ppl", "target_agreement")),
                            ("2. multi-turn TTFT", "multiturn", ("target", "target_llama_cpp")),
                            ("2b. short turns TTFT", "multiturn_short", ("target_llama_cpp",)),
                            ("3. batched decode", "batched", ("target_tok_s", "target")),
                            ("4. single-stream decode", "single_stream", ("target_llama_cpp", "target")),
                            ("5. long context", "long_context", ("target_prefill", "target_decode"))):
        sec_r = R.get(key)
        if not sec_r:
            err = (R.get("errors") or {}).get(key)
            L.append(f"| {sec} | {'(failed: ' + err[:200] + ')' if err else '(skipped)'} | | | n/a |")
            continue
        for tk in tkeys:
            t = sec_r.get(tk)
            if t:
                L.append(_target_row(sec, t))
    L.append("")


def _render_formats(L: list, R: dict) -> None:
    """Section 0: the weight formats' memory, speed and quality."""
    fm = R.get("formats")
    L.append("## 0. Weight formats (`--quantization`)\n")
    if fm:
        L.append(f"Each format in its own engine. Perplexity: {fm['ppl_text']}. Agreement: {fm['agreement']}. "
                 "Resident memory: a fresh process after `LLMEngine(quantization=...)` with a 64-block KV pool, and "
                 "after its first two tokens (weights mapped from the cache are resident once used) (VmRSS; "
                 "includes the Python runtime, torch and the tokenizer). Decode: single stream, 128 tokens "
                 f"after a chat prompt, best of 2. Default format here: **{fm['default']}**.\n")
        L.append("| format | weights | bytes per weight (decode step) | RSS after load MiB | RSS after 2 tokens MiB "
                 "| peak RSS MiB | decode tok/s | perplexity | vs none | identical continuations | top-1 agreement |"
                 "\n|---|---|---|---|---|---|---|---|---|---|---|")
        for r in fm["formats"]:
            if r.get("failed"):
                L.append(f"| {r['format']} | failed: {r['failed'][:200]} | | | | | | | | | |")
                continue
            mem = r.get("memory") or {}
            vs = r.get("ppl_vs_none")
            L.append(f"| {r['format']} | {r.get('description')} | {_f(r.get('bytes_per_weight'), 3)} | "
                     f"{_f(mem.get('rss_after_load_mib'), 0)} | {_f(mem.get('rss_after_first_tokens_mib'), 0)} | "
                     f"{_f(mem.get('peak_rss_mib'), 0)} | "
                     f"{_f(r.get('decode_tok_per_s'))} | {_f(r.get('ppl'), 3)} | "
                     f"{'' if vs is None else f'{100 * vs:+.2f}%'} | {r.get('identical_continuations', '')} | "
                     f"{_f(None if r.get('top1_agreement') is None else 100 * r['top1_agreement'], 2, '%')} |")
        L.append("")
        for tk in ("target_ppl", "target_agreement"):
            if fm.get(tk):
                L.append(f"Target: {_target_row('formats', fm[tk])}")
    else:
        L.append(f"failed or skipped: {(R.get('errors') or {}).get('formats')}")
    L.append("")


def _render_roofline(L: list, R: dict) -> None:
    """Section 1: the machine's roofline, the model's costs and kvkeeper's fractions of the limits."""
    m = R["machine"]
    roof = R.get("roofline")
    L.append("## 1. Roofline of this machine (measured in this run)\n")
    if roof:
        mc = R["model_costs"]
        L.append("| measurement | best | median | how |\n|---|---|---|---|")
        c, mm, g = roof["copy"], roof["matmul"], roof["gemv"]
        L.append(f"| memory copy bandwidth | {c['gb_per_s']:.1f} GB/s | {c['gb_per_s_median']:.1f} GB/s | "
                 f"copy_ of {c['buffer_mib']} MiB fp32 (written first), read+write bytes, {c['reps']} reps |")
        L.append(f"| fp32 matmul | {mm['gflop_per_s']:.1f} GFLOP/s | {mm['gflop_per_s_median']:.1f} GFLOP/s | "
                 f"torch.mm {mm['n']}^3, {m['torch_threads']} threads, {mm['reps']} reps |")
        rd = roof.get("read")
        if rd:
            L.append(f"| memory read bandwidth | {rd['gb_per_s']:.1f} GB/s | {rd['gb_per_s_median']:.1f} GB/s | "
                     f"sum() over {rd['buffer_mib']} MiB fp32, {rd['reps']} reps |")
        q = roof.get("qmm") or {}
        if q.get("gop_per_s"):
            L.append(f"| kvkeeper block matmul (int8 x int4, {q['isa']}) | {q['gop_per_s']:.0f} GOP/s | "
                     f"{q['gop_per_s_median']:.0f} GOP/s | {q['shape']}, {q['reps']} reps |")
        L.append(f"| fp32 GEMV weight streaming | {g['gb_per_s']:.1f} GB/s | {g['gb_per_s_median']:.1f} GB/s | "
                 f"x(1,in) @ W.T over {g['matrices']} distinct matrices shaped like the model, "
                 f"{g['bytes'] / 1e6:.0f} MB, {g['reps']} reps |")
        pr = roof.get("small_m_probe")
        if pr:
            L.append(f"| small-M GEMM probe (4x576 @ 576x3072) | main thread {pr['main_thread_ms']:.2f} ms | "
                     f"helper thread {pr['helper_thread_ms']:.2f} ms | main/helper {pr['main_over_helper']:.1f}x "
                     "(>> 1: OpenMP threads stalled by a busy machine) |")
        L.append("")
        L.append(f"| model cost (SmolLM2-135M, weights {mc.get('weight_format')}) | value |\n|---|---|")
        L.append(f"| parameters | {mc['params_total'] / 1e6:.1f} M (tied embeddings: {mc['tie_word_embeddings']}) |")
        L.append(f"| weight bytes read per decode step | {mc['weight_bytes_per_decode_step'] / 1e6:.0f} MB "
                 f"(+ {mc['kv_bytes_per_token']} B KV per context token) |")
        L.append(f"| prefill FLOP per token (matmuls, 2 x {mc['params_per_prefill_token'] / 1e6:.1f} M) | "
                 f"{2 * mc['params_per_prefill_token'] / 1e6:.0f} MFLOP (+ attention, + one lm_head row per prompt) |")
        d = R["roofline_limits"]
        L.append(f"| decode limit, 1 stream, empty context (weight bytes / read BW) | {d['decode_tok_s_ctx0']:.1f} tok/s |")
        L.append(f"| prefill limit (2 x all params per token / projection rate) | {d['prefill_tok_s_2xparams']:.0f} tok/s |")
        L.append(f"| prefill limit (2 x matmul params per token / projection rate) | {d['prefill_tok_s_matmul']:.0f} tok/s |")
        L.append("")
        if R.get("roofline_fractions"):
            L.append("| kvkeeper vs roofline | kvkeeper | limit | fraction of limit |\n|---|---|---|---|")
            for r in R["roofline_fractions"]:
                L.append(f"| {r['what']} | {r['kvkeeper']:.1f} {r['unit']} | {r['limit']:.1f} {r['unit']} | "
                         f"{100 * r['fraction']:.0f}% |")
            L.append("\nLimits: decode = max(bytes / read BW, projection ops / projection rate) per step with the KV "
                     "of the context included; prefill = max(projection ops / projection rate + causal attention "
                     "FLOPs / fp32 matmul rate, one weight and KV pass / read BW). Projection rate: the block "
                     "matmul's for a quantized format, fp32 matmul's for none.")
    else:
        L.append(f"failed: {(R.get('errors') or {}).get('roofline')}")
    L.append("")


def _render_batched(L: list, R: dict) -> None:
    """Section 3: batched decode against generate_batch and padded generate."""
    b = R.get("batched")
    L.append("## 3. Batched decode\n")
    if b:
        L.append(f"{b['requests']} concurrent requests ({b['prompts_from']}; prompt tokens "
                 f"{min(b['prompt_tokens'])}-{max(b['prompt_tokens'])}), {b['new_tokens_each']} new tokens each, "
                 "EOS ignored (kvkeeper `ignore_eos=True`; generate `min_new_tokens`; generate_batch `eos_token_id=-1`).\n")
        L.append("| engine | wall s | total tok/s | decode-only tok/s | exact length | kvkeeper / peer (total) | "
                 "kvkeeper / peer (decode-only) | greedy rows equal kvkeeper |\n|---|---|---|---|---|---|---|---|")
        kv = b["kvkeeper"]
        L.append(f"| kvkeeper `generate` | {kv['wall_s']:.2f} | {kv['tok_per_s']:.1f} | "
                 f"{_f(kv.get('decode_only_tok_per_s'))} | {_f(kv['all_exact_length'])} | | | |")
        for key, name in (("transformers_generate_batch", "transformers `generate_batch`"),
                          ("transformers_generate_padded", "transformers `generate` (left-padded)")):
            p = b.get(key)
            if not p:
                L.append(f"| {name} | not run | | | | | | |")
            elif p.get("failed"):
                L.append(f"| {name} | failed (see below) | | | | | | |")
            else:
                L.append(f"| {name} | {p['wall_s']:.2f} | {p['tok_per_s']:.1f} | {_f(p.get('decode_only_tok_per_s'))} | "
                         f"{_f(p['all_exact_length'])} | {_f(p['ratio_kvkeeper_over_peer_total'], 2, 'x')} | "
                         f"{_f(p['ratio_kvkeeper_over_peer_decode_only'], 2, 'x')} | "
                         f"{p['rows_equal_to_kvkeeper_until_eos']} |")
        t = b["target"]
        L.append(f"\nTarget: {t['metric']} >= {t['target']:g}x; measured {_f(t['measured'], 2, 'x')}: {_met(t)}.")
        gb = b.get("transformers_generate_batch") or {}
        if gb.get("signature"):
            L.append(f"\n`{gb['signature']}`" + (f"; ran with {gb['config']}" if gb.get("config") else ""))
        for e in gb.get("errors", []):
            L.append(f"\ngenerate_batch error: `{e[:500]}`")
        if gb.get("prefill_phase_s") is not None:
            L.append(f"\ngenerate_batch timeline (inside its wall time): first token of every request after "
                     f"{gb['prefill_phase_s']:.2f} s; {gb.get('after_last_token_s', 0):.2f} s from the last token "
                     "to the return (manager shutdown).")
        if gb.get("note"):
            L.append(f"\nNote: {gb['note']}")
        pg = b.get("transformers_generate_padded") or {}
        for e in pg.get("errors", []):
            L.append(f"\npadded generate error: `{e[:500]}`")
        L.append("\nDecode-only: tokens produced after every request has its first token, over the time after "
                 "that point (kvkeeper, generate_batch timestamps); padded generate: "
                 "(N x (M-1)) / (t(M tokens) - t(1 token)).")
    else:
        L.append(f"failed: {(R.get('errors') or {}).get('batched')}")
    L.append("")


def _render_single(L: list, R: dict) -> None:
    """Section 4: single-stream decode against generate and llama.cpp."""
    s = R.get("single_stream")
    L.append("## 4. Single-stream decode\n")
    if s:
        L.append(f"{s['prompt']} ({s['prompt_tokens']} tokens), {s['new_tokens']} new tokens, EOS ignored. "
                 "Decode tok/s = (n-1)/(t_last - t_first) for both (transformers via a streamer).\n")
        L.append("| engine | TTFT ms | decode tok/s | wall s |\n|---|---|---|---|")
        k = s["kvkeeper"]
        L.append(f"| kvkeeper | {_ms(k['ttft_s'])} | {_f(k['decode_tok_per_s'])} | {k['wall_s']:.2f} |")
        h = s.get("transformers_generate")
        if h:
            L.append(f"| transformers `generate` | {_ms(h['ttft_s'])} | {_f(h['decode_tok_per_s'])} | {h['wall_s']:.2f} |")
        lc = s.get("llama_cpp")
        if lc and not lc.get("failed"):
            L.append(f"| llama.cpp (streamed) | {_ms(lc['ttft_s'])} | {_f(lc['decode_tok_per_s'])} | {lc['wall_s']:.2f} |")
        elif lc:
            L.append(f"| llama.cpp | failed: {lc['failed'][:200]} | | |")
        L.append("")
        for tk in ("target_llama_cpp", "target"):
            if s.get(tk):
                L.append(f"Target: {_target_row('single-stream', s[tk])}")
        if "greedy_tokens_equal" in s:
            L.append(f"\nGreedy tokens kvkeeper == transformers: {_f(s['greedy_tokens_equal'])} "
                     f"({s['greedy_compared_tokens']} tokens compared; {s['greedy_note']}).")
    else:
        L.append(f"failed: {(R.get('errors') or {}).get('single_stream')}")
    L.append("")


def _render_long_context(L: list, R: dict) -> None:
    """Section 5: prefill of a long prompt and decode after it."""
    lg = R.get("long_context")
    L.append("## 5. Long context: prefill and decode after it\n")
    if lg:
        L.append(f"{lg['prompt']}: {lg['prompt_tokens']} prompt tokens, then {lg['new_tokens']} greedy tokens (EOS "
                 f"ignored). Prefill = time to the first token; decode tok/s = (n-1)/(t_last - t_first). kvkeeper KV "
                 f"cache {lg['kvkeeper']['kv_dtype']}; llama.cpp: {lg['llama_cpp_status']}.\n")
        L.append("| engine | prefill s | prefill tok/s | decode tok/s after the prompt |\n|---|---|---|---|")
        for name, r in ((f"kvkeeper (KV {lg['kvkeeper']['kv_dtype']}, the default)", lg["kvkeeper"]),
                        (f"kvkeeper, KV {(lg.get('kvkeeper_other_kv') or {}).get('kv_dtype')} (`--kv-dtype`)",
                         lg.get("kvkeeper_other_kv")),
                        ("llama.cpp (its default KV: f16)", lg.get("llama_cpp"))):
            if r and not r.get("failed"):
                L.append(f"| {name} | {_f(r['prefill_s'], 2)} | {_f(lg['prompt_tokens'] / r['prefill_s'], 0)} | "
                         f"{_f(r['decode_tok_per_s'])} |")
            elif r:
                L.append(f"| {name} | failed: {r['failed'][:200]} | | |")
        L.append("")
        for tk in ("target_prefill", "target_decode"):
            if lg.get(tk):
                L.append(f"Target: {_target_row('long context', lg[tk])}")
    else:
        L.append(f"failed or skipped: {(R.get('errors') or {}).get('long_context')}")
    L.append("")


def _render_checks(L: list, R: dict) -> None:
    """The correctness cross-checks of the run, then its errors."""
    s = R.get("single_stream")
    b = R.get("batched")
    mt = R.get("multiturn")
    L.append("## Correctness cross-checks (same run)\n")
    L.append("| check | result |\n|---|---|")
    if mt:
        L.append(f"| multi-turn: first token of kvkeeper (reuse) = no-reuse = transformers, every turn | "
                 f"{_f(mt['first_token_agrees_all_turns'])} |")
        ok = all(r["turn"] == 1 or r["cached_tokens"] > 0 for r in mt["turns"])
        L.append(f"| multi-turn: turns >= 2 reuse cached tokens | {_f(ok)} |")
    if s and "greedy_tokens_equal" in s:
        L.append(f"| single-stream greedy tokens equal transformers | {_f(s['greedy_tokens_equal'])} |")
    if b:
        for key, name in (("transformers_generate_batch", "generate_batch"), ("transformers_generate_padded", "padded generate")):
            p = b.get(key) or {}
            if "rows_equal_to_kvkeeper_until_eos" in p:
                L.append(f"| batched: greedy rows equal to {name} (until kvkeeper's first EOS) | "
                         f"{p['rows_equal_to_kvkeeper_until_eos']} |")
    if R.get("errors"):
        L.append("\n## Errors\n")
        for k, v in R["errors"].items():
            L.append(f"- {k}: `{v[:500]}`")


def render_markdown(R: dict) -> str:
    """The run's results (engine_bench's JSON) as one markdown document: header, targets, then each section."""
    L: list[str] = []
    _render_header(L, R)
    _render_targets(L, R)
    _render_formats(L, R)
    _render_roofline(L, R)
    for key, title in (("multiturn", "## 2. Multi-turn TTFT"), ("multiturn_short", "## 2b. Short turns: TTFT")):
        _render_multiturn(L, R, key, title)
    _render_batched(L, R)
    _render_single(L, R)
    _render_long_context(L, R)
    _render_checks(L, R)
    return "\n".join(L) + "\n"
