"""The short table the device run prints at its end, one line per section; BENCHMARKS.md shows the same
(benchmarks/make_report.py imports it, so the report needs no torch)."""
from __future__ import annotations

_SHOWN = ("ok", "max_abs_err", "completed", "finished", "requests", "output_tok_s", "decode_tok_s",
          "async_decode_tok_s", "async_tokens_identical", "async_scheduling", "tok_s", "mfu", "tflops", "largest_step",
          "activation_peak_gib", "plan_activation_peak_gib", "device_peak_gib", "startup_s", "max_num_batched_tokens",
          "wall_s", "build_s")


def table(results: dict) -> str:
    lines = []
    for name, res in results["sections"].items():
        if "error" in res or "skipped" in res:
            cells = [f"ERROR {res['error'][:100]}" if "error" in res else f"skipped ({res['skipped']})"]
        elif name == "kernel_check":
            cells = [f"{k}: err {v['max_abs_err']:.1e} {'ok' if v['ok'] else 'FAIL'}" for k, v in res.items()
                     if isinstance(v, dict)]
        elif name == "engine_vs_hf":
            cells = [f"ok={res['ok']}"] + [
                f"{model}/{k}: " + (f"{v['matching_prefix']}" if "matching_prefix" in v else
                                    f"{v['hit_tokens']} hit tokens, {v['checkpoints']} checkpoints")
                for model, r in res.items() if isinstance(r, dict) for k, v in r.items() if isinstance(v, dict)]
        elif name == "fp8_check":
            cells = [f"ok={res['ok']}"] + [
                f"fp8 x{k}: err {v['max_rel_err']:.1e}" + (f", {v['fp8_over_bf16']:.2f}x bf16's time"
                                                           if "fp8_over_bf16" in v else "")
                for k, v in res["fp8_linear"].items()] + [
                f"{f} experts: err {res[f + '_experts_max_rel_err']:.1e}"
                + (f", {res[f + '_experts_over_bf16']:.2f}x bf16's time" if f + "_experts_over_bf16" in res else "")
                for f in ("fp8", "mxfp4")]
        elif name == "spec_decode":
            cells = [f"ok={res['ok']}"] + [
                f"{k}: tokens equal {v['tokens_identical']}, x{v['speedup']} ({v['dtype']}), "
                f"accepted {v['acceptance_rate']}" for k, v in res.items() if isinstance(v, dict)]
        elif name == "prefix_checkpoints":
            cells = [f"ok={res['ok']}"] + [
                f"{k}: replies equal {v['replies_identical']}, computed x{v['computed_ratio']}, "
                f"TTFT x{v['ttft_ratio']}" for k, v in res.items() if isinstance(v, dict)]
        elif name == "host_tier":
            c, sess = res["copy"], res["sessions"]
            off, on = (v for k, v in sess.items() if isinstance(v, dict))
            cells = [f"ok={res['ok']}", f"promote {c['promote_us_per_block']}us/block ({c['promote_gb_s']} GB/s)",
                     f"demote {c['demote_us_per_block']}us/block ({c['demote_gb_s']} GB/s)",
                     f"sessions: replies equal {sess['replies_identical']}, computed/new {off['computed_over_new_median']}"
                     f" -> {on['computed_over_new_median']}, TTFT p50 x{sess['ttft_p50_off_over_on']} lower"]
        elif name == "gguf":
            cells = [f"ok={res['ok']}"] + [f"{k}: tokens equal CPU's {v['tokens_identical']}"
                                           for k, v in res.items() if isinstance(v, dict)]
        elif name == "ops_check":
            cells = [f"ok={res['ok']}"] + [
                f"{k}: {v.get('bitwise_equal', v.get('matching_prefix'))}"
                for k, v in res.items() if isinstance(v, dict)]
        elif name.endswith("cuda_graphs"):
            cells = [f"capture {res['capture_s']}s"] + [
                f"{k}: eager {v['eager_ms']}ms graph {v['graph_ms']}ms (x{v['speedup']}, "
                f"{'logit' if 'max_abs_logit_diff' in v else 'hidden'} diff "
                f"{v.get('max_abs_logit_diff', v.get('max_abs_hidden_diff')):.1e})"
                for k, v in res.items() if isinstance(v, dict)]
        elif name == "tensor_parallel":
            cells = [f"greedy = TP 1: {res['greedy_identical_to_tp1']}"] + [
                f"TP {k}: {v['output_tok_s']} tok/s, broadcast {v['broadcast_ms_per_step']} ms/step"
                for k, v in res["throughput"].items()]
        elif name == "expert_tiering":
            cells = [f"{k}: agree {v['agreement']}, decode x{v['decode_ratio']}, prefill x{v['prefill_ratio']}"
                     + (f", hits {v['hit_rate']}" if v.get("hit_rate") is not None else "")
                     for k, v in res.items() if isinstance(v, dict)]
        elif name == "kernel_speed":
            cells = [f"{k} {v['ms']}ms {v['tflops']}TF {v['kv_gb_s']}GB/s" for k, v in res.items()
                     if isinstance(v, dict)]
        else:
            cells = [f"{k}={res[k]}" for k in _SHOWN if res.get(k) is not None]
        lines.append(f"{name:<30} " + "  ".join(cells))
    return "\n".join(lines)
