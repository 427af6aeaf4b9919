"""The report section of benchmarks/llamacpp_gguf.py: SmolLM2's GGUF in ladle beside llama.cpp, same file, same
token ids, same threads."""
from __future__ import annotations

import os
import statistics
import sys
from typing import Any

from report_common import table

WHAT = {
    "decode": "batch-1 decode tok/s",
    "prefill": "512-token prefill tok/s",
    "concurrent": "16 concurrent requests, aggregate output tok/s",
}


def _what(r: dict[str, Any]) -> dict[str, str]:
    s = r["settings"]
    return {
        "decode": f"a {s['short_len']}-token prompt, {s['decode_tokens'] + 1} tokens streamed: {s['decode_tokens']} "
                  "/ the time from the first token's event to the last's, at the client",
        "prefill": f"one {s['prefill_len']}-token prompt, max_tokens 1, nothing cached: {s['prefill_len']} / the "
                   "request's time at the client, sent to answered",
        "concurrent": f"{s['concurrency']} different {s['short_len']}-token prompts sent at once, "
                      f"{s['concurrent_tokens']} tokens each, not streamed: {s['concurrency']} x "
                      f"{s['concurrent_tokens']} / first send to last answer",
    }


def main_table(r: dict[str, Any]) -> list[str]:
    """ladle (each dtype) / llama.cpp / ratio / goal, one row per measurement. The ratio is of the medians, and
    in brackets the median of the rounds' ratios (each side's median within a round, which drift between rounds
    leaves alone); the goal is judged on the first ladle dtype (fp32, ladle's CPU default), by both."""
    dtypes, summ, goals = r["ladle_dtypes"], r["summary"], r["goals"]
    head = ["measurement"] + [f"ladle {d}" for d in dtypes] + ["llama.cpp"] + \
        [f"ladle {d} / llama.cpp (per round)" for d in dtypes] + ["goal", ""]
    rows = []
    for kind in ("decode", "prefill", "concurrent"):
        ll = summ[kind]["llama.cpp"]["median"]
        ours = [summ[kind][f"ladle {d}"] for d in dtypes]
        ratios = [x["median"] / ll for x in ours]
        paired = [x.get("per_round_ratio_median", float("nan")) for x in ours]
        goal = goals[kind]
        both = [a >= goal and not b < goal for a, b in zip(ratios, paired)]
        either = [a >= goal or b >= goal for a, b in zip(ratios, paired)]
        verdict = ("met" if both[0] else "met by one ratio, not the other" if either[0]
                   else f"missed ({ratios[0] / goal:.2f} of the goal)")
        others = [d for d, ok in zip(dtypes[1:], both[1:]) if ok]
        if not both[0] and others:
            verdict += f"; {', '.join(others)} meets it"
        rows.append([WHAT[kind]] + [f"{x['median']:.1f}" for x in ours] + [f"{ll:.1f}"]
                    + [f"**{a:.2f}x** ({b:.2f}x)" for a, b in zip(ratios, paired)] + [f">= {goal:g}x", verdict])
    return table(head, rows)


def llamacpp_gguf(r: dict[str, Any]) -> list[str]:
    s, summ, ref = r["settings"], r["summary"], r.get("reference", {})
    dtypes = r["ladle_dtypes"]
    servers = {x["name"]: x for x in r["servers"]}
    m = r["machine"]
    lines = ["## SmolLM2 GGUF beside llama.cpp", "",
             f"Reproduce: `{r['command']}`", "",
             f"`{r['gguf_name']}` ({r['gguf_bytes'] / 2**20:.1f} MiB), one file for both engines. llama.cpp "
             f"{r['llamacpp_version']}, built by the script from the {r['llamacpp_build']['source']} "
             f"(`cmake {r['llamacpp_build']['cmake']}`, -march=native; never a test dependency). CPU: {r['cpu']}; "
             f"{r['threads']} threads each: `ladle serve --num-threads {r['threads']}`, `llama-server -t "
             f"{r['threads']} -tb {r['threads']}`, on a machine shared with another job (below: how its load is kept "
             "out of the numbers).", "",
             "All servers are up at once and take turns: one is measured while the others idle (their CPU time is "
             "checked around every measurement), after a "
             f"{s['settle_s']:g} s pause, in {s['rounds']} rounds with the engines in rotating order. One client "
             "(httpx, in the script's process) sends every engine the same OpenAI `/v1/completions` requests: token "
             f"ids as prompts ({r['workload']['text_source']}), greedy, `ignore_eos`. Medians of the repeats; "
             "ratio is ladle / llama.cpp (above 1: ladle faster).", ""]
    lines += main_table(r) + [""]
    what = _what(r)
    lines += ["What each number is:", ""]
    for kind in ("decode", "prefill", "concurrent"):
        lines.append(f"- **{WHAT[kind]}**: {what[kind]}.")
    lines += [f"- llama.cpp's batch-1 rows come from `llama-server -np 1 -c 2048`, its concurrent row from "
              f"`llama-server -np {s['concurrency']} -c {s['concurrency'] * s['slot_ctx']} -cb` ({s['slot_ctx']} "
              "tokens a slot, continuous batching), each request with `cache_prompt: false`; ladle's rows from one "
              "`ladle serve` per dtype, prefix caching off (`--no-enable-prefix-caching`), other settings its "
              "defaults. Every answer's usage is checked: the prompt's tokens, none cached, the tokens asked for.",
              ""]
    lines += ["Round by round (each side's median within the round; the brackets above are their medians):", ""]
    for kind in ("decode", "prefill", "concurrent"):
        for d in dtypes:
            e = summ[kind][f"ladle {d}"]
            if "per_round_ratio" in e:
                lines.append(f"- ladle {d} / llama.cpp, {WHAT[kind]}: "
                             + ", ".join(f"{x:.2f}" for x in e["per_round_ratio"]) + ".")
    lines.append("")
    rows = []
    for kind in ("decode", "prefill", "concurrent"):
        for name, e in summ[kind].items():
            foreign = [c["foreign_cpus"] for c in r["cells"] if c["kind"] == kind and c["engine"] == name]
            rows.append([WHAT[kind], name, f"{e['median']:.1f}", ", ".join(f"{x:.1f}" for x in e["repeats"]),
                         f"{statistics.median(foreign):.2f} / {max(foreign):.2f}"])
    lines += ["Every repeat (tok/s, in the order measured), and the CPUs other jobs on the machine kept busy "
              "meanwhile (/proc/stat's busy time less this benchmark's processes', over the measurement's wall "
              f"time; of {m['cpus']}). Before each measurement the script waits, up to "
              f"{s['quiet_wait_s']:g} s, until other jobs use under {s['quiet_cpus']:g} CPUs for a second.", ""]
    lines += table(["measurement", "engine", "median", "repeats", "other jobs' CPUs, median / max"], rows) + [""]
    lines += ["Each engine's own accounting, for reference (not the comparison above): llama-server's `timings` "
              "of the same requests (server-side, no HTTP), `llama-bench` run after the servers stopped, and "
              "ladle's offline `LLM.generate` in a fresh process with the same threads (prefill: a generate of the "
              f"{s['prefill_len']}-token prompt with max_tokens 1; decode: (t({s['decode_tokens'] + 1} tokens) - "
              f"t(1 token)) / {s['decode_tokens']}, each a fresh generate).", ""]
    rows = []
    ll = {k: summ[k]["llama.cpp"] for k in summ}
    rows.append(["llama-server timings", f"{ll['prefill'].get('server_prompt_per_second_median', float('nan')):.1f}",
                 f"{ll['decode'].get('server_predicted_per_second_median', float('nan')):.1f}",
                 f"{ll['concurrent'].get('server_predicted_per_second_per_request_median', float('nan')):.1f} "
                 "per request"])
    if "llama_bench" in ref:
        b = ref["llama_bench"]
        rows.append([f"`llama-bench` {b['prefill']['test']} / {b['decode']['test']}",
                     f"{b['prefill']['tok_per_s']:.1f} ± {b['prefill']['stddev']:.1f}",
                     f"{b['decode']['tok_per_s']:.1f} ± {b['decode']['stddev']:.1f}", "-"])
    for d, o in ref.get("ladle_offline", {}).items():
        rows.append([f"ladle offline LLM, {d}",
                     f"{o['prefill_median']:.1f} ({', '.join(f'{x:.0f}' for x in o['prefill_tok_per_s'])})",
                     f"{o['decode_median']:.1f} ({', '.join(f'{x:.1f}' for x in o['decode_tok_per_s'])})", "-"])
    lines += table(["source", f"prefill tok/s ({s['prefill_len']} tokens)", "batch-1 decode tok/s",
                    "concurrent decode tok/s"], rows) + [""]
    busy = ([ref["llama_bench"]["foreign_cpus"]] if "llama_bench" in ref else []) + [
        t["foreign_cpus"] for o in ref.get("ladle_offline", {}).values() for t in o.get("taken", [])]
    if busy:
        lines += [f"These are taken as quietly as the rest (other jobs' CPUs while they ran: at most {max(busy):.2f}).",
                  ""]
    idle = max((v for c in r["cells"] for v in c["others_cpu_s"].values()), default=0.0)
    again = sum(len(c["discarded"]) for c in r["cells"])
    loaded = [c for c in r["cells"] if c["foreign_cpus"] > s["quiet_cpus"]]
    home = os.path.expanduser("~")
    lines += ["Servers, each started by the script (startup: launch to a healthy /health):", ""]
    shown = {x["name"]: x["command"].split(" --host ")[0].replace(sys.executable, "python").replace(home, "~")
             for x in servers.values()}
    lines += table(["server", "command (and `--host 127.0.0.1 --port N`)", "startup s"],
                   [[x["name"], f"`{shown[x['name']]}`", f"{x['startup_s']:.1f}"] for x in servers.values()]) + [""]
    lines += [
        f"The idle servers used at most {idle:.2f} CPU s during any one measurement. {again} measurement(s) were "
        f"taken again because other jobs kept more than {s['quiet_cpus']:g} CPUs busy while they ran (their "
        f"numbers are in the JSON's `discarded`); {len(loaded)} kept measurement(s) still ran beside such load "
        f"(after {s['retries']} retries). The run took {r['wall_s'] / 60:.0f} minutes.", ""]
    texts = r.get("decode_texts", {})
    if texts:
        base = texts.get("llama.cpp", "")
        same = []
        for name, t in texts.items():
            if name == "llama.cpp":
                continue
            k = next((i for i, (a, b) in enumerate(zip(base, t)) if a != b), min(len(base), len(t)))
            same.append(f"{name} {'identical' if t == base else f'the same for the first {k} characters'}")
        lines += [f"Greedy text of the decode request against llama.cpp's: {'; '.join(same)} (llama.cpp multiplies "
                  "Q4_1 blocks by activations it rounds to 8 bits, ladle by its fp32 / bf16 activations, so "
                  "greedy paths may part where two tokens are close).", ""]
    return lines
