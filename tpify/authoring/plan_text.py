"""``tpify plan``'s report as plain-text tables (:func:`render_text` of
:func:`tpify.authoring.plan.plan_report`'s data): one line per parameter, replicated layers
grouped by layer index."""

from __future__ import annotations

__all__ = ["render_text"]


def _bytes(n: int) -> str:
    return f"{n:,} B ({n / 2**20:.2f} MiB)"


def _table(rows: list[list[str]], header: list[str], indent: str = "  ") -> list[str]:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: indent + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def _pattern(fqn: str) -> str:
    """``transformer.h.3.ln_1.weight`` -> ``transformer.h.*.ln_1.weight`` (layers grouped in text)."""
    return ".".join("*" if seg.isdigit() else seg for seg in fqn.split("."))


def _grouped(items: list[dict], name_key: str, same: tuple[str, ...]) -> list[tuple[str, int, dict]]:
    """Items whose names differ only in layer indices and agree on ``same``, grouped in first-seen
    order: ``(name or pattern, count, first item)``."""
    groups: dict[tuple, list[dict]] = {}
    for item in items:
        key = (_pattern(item[name_key]),) + tuple(repr(item[k]) for k in same)
        groups.setdefault(key, []).append(item)
    return [(members[0][name_key] if len(members) == 1 else key[0], len(members), members[0])
            for key, members in groups.items()]


def _shape(s) -> str:
    return "[" + ", ".join(str(x) for x in s) + "]"


def render_text(report: dict) -> str:
    """The report of :func:`tpify.authoring.plan.plan_report` as plain-text tables (one line per parameter)."""
    r = report
    ep = f", ep_size = {r['ep_size']} (whole experts per rank)" if r.get("ep_size", 1) > 1 else ""
    lines = [f"tpify plan: {r['head_class']} (model_type {r['model_type']!r}, target {r['target']}) at tp_size = "
             f"{r['tp_size']}{ep}",
             f"recipe: {r['recipe']}",
             f"dtype: {r['dtype']} ({r['dtype_source']})", ""]
    if r["recipe_model_type"] != r["model_type"]:
        lines.insert(2, f"note: the recipe is written for model_type {r['recipe_model_type']!r}")
    lines.append(f"Shardable modules ({len(r['modules'])}; shapes in each layer's own layout, per rank = every rank; "
                 f"an uneven split: rank 0's, every rank's in the notes):")
    lines += _table(_module_table(r["modules"]), ["module", "type", "rule", "style", "param", "dense shape",
                                                  "per rank", "notes"])
    lines += _memory_lines(r)
    if r.get("quantized"):
        lines += _quantized_lines(r["quantized"], r["dtype"])
    lines += _divided_lines(r)
    lines += ["", "Rules that took no part:"]
    if not r["unused_rules"]:
        lines.append("  (none: every rule matched)")
    for u in r["unused_rules"]:
        what = f"style {u['style']}" if u["style"] else f"divide {u['divide']}"
        lines.append(f"  rule #{u['index']} match={u['match']} ({what}): {u['reason']}")
    lines += ["", "Replicated (a full copy on every rank; layers alike grouped, * = layer index):"]
    rep_rows = [[name, str(count), x["module_type"], _shape(x["shape"]), f"{x['bytes']:,}", f"{x['bytes'] * count:,}",
                 x["reason"] + (f"; tied to {', '.join(x['tied_to'])}" if x["tied_to"] else "")]
                for name, count, x in _grouped(r["replicated"], "param", ("module_type", "shape", "reason", "tied_to"))]
    lines += (_table(rep_rows, ["parameter", "count", "module type", "shape", "bytes each", "bytes in all", "why"])
              if rep_rows else ["  (nothing)"])
    lines += [""]
    lines += _head_lines(r)
    return "\n".join(lines) + "\n"


def _module_table(modules: list[dict]) -> list[list[str]]:
    """One row per parameter of each shardable module; the module's columns on its first row."""
    rows = []
    for m in modules:
        notes = []
        if m["partition_sizes"]:
            notes.append(f"parts {m['partition_sizes']}")
        if m["replicated_parts"]:
            kv = m.get("replica_shards", 1)
            notes.append(f"parts {m['replicated_parts']} whole" if kv == 1 else
                         f"parts {m['replicated_parts']}: {kv} KV heads, each on a group of ranks")
        if m["padded_size"] and m["padded_size"] != m["vocab_size"]:
            notes.append(f"vocab {m['vocab_size']} padded to {m['padded_size']}")
        if m["output_scale"] is not None:
            notes.append(f"output scaled by {m['output_scale']:g}")
        if m["container"]:
            notes.append(f"inside replicated container {m['container']}")
        if m.get("uneven"):
            notes.append("split unevenly (torch.chunk's rule)")
        if m.get("note"):  # what the style says of its split (tpify.styles.Style.explain)
            notes.append(m["note"])
        for i, p in enumerate(m["params"]):
            pnotes = list(notes) if i == 0 else []
            if p.get("rank_shapes"):
                pnotes.append("ranks: " + ", ".join(_shape(s) for s in p["rank_shapes"]))
            if p["tied_to"]:
                counted = f"{m['fqn']}.{p['name']}" == p["counted_as"]
                where = ("" if counted else " (counted there)" if p["tied_to"] == [p["counted_as"]]
                         else f" (counted as {p['counted_as']})")
                pnotes.append(f"tied to {', '.join(p['tied_to'])}{where}")
            first = i == 0
            rows.append([m["fqn"] if first else "", m["type"] if first else "",
                         f"#{m['rule']} {m['matched_by'] or m['match'][0]}" if first else "",
                         m["style"] if first else "", p["name"], _shape(p["dense_shape"]), _shape(p["rank_shape"]),
                         "; ".join(pnotes)])
    return rows


def _memory_lines(r: dict) -> list[str]:
    mem = r["memory"]
    uneven = "; rank 0's, the largest, where a split is uneven" if any(m.get("uneven") for m in r["modules"]) else ""
    return ["", f"Parameter memory per rank ({r['dtype']}; tied parameters once, replicated ones in full on "
                f"every rank{uneven}):",
            f"  dense:      {_bytes(mem['dense_bytes'])}, {mem['dense_params']:,} parameters",
            f"  per rank:   {_bytes(mem['rank_bytes'])}, {mem['rank_params']:,} parameters = "
            f"{mem['ratio']:.4f} x dense",
            f"    sharded:    {_bytes(mem['sharded_rank_bytes'])} (dense {_bytes(mem['sharded_dense_bytes'])})",
            f"    replicated: {_bytes(mem['replicated_bytes'])}", ""]


def _quantized_lines(q: dict, dtype: str) -> list[str]:
    rank, dense = q["rank"], q["dense"]
    return [f"QLoRA base per rank ({q['quant_type']}, blocks of {q['blocksize']}; {len(q['layers'])} quantized layers; "
            f"rank 0):",
            f"  quantized:  {_bytes(rank['quantized_bytes'])} = codes {_bytes(rank['codes'])} + absmax "
            f"{_bytes(rank['absmax'])} + code tables {_bytes(rank['code_table'])} (dense {_bytes(dense['quantized_bytes'])}: "
            f"{q['quantized_ratio']:.4f} x)",
            f"  kept {dtype}: {_bytes(rank['kept_bytes'])} (norms, embeddings, LM head, biases; dense "
            f"{_bytes(dense['kept_bytes'])})",
            f"  base:       {_bytes(rank['base_bytes'])} (dense {_bytes(dense['base_bytes'])})",
            f"  LoRA r = {q['lora_r']} on the quantized layers ({q['lora_dtype']}): {_bytes(rank['lora_bytes'])} (dense "
            f"{_bytes(dense['lora_bytes'])}); gradients as much again, AdamW state twice", ""]


def _divided_lines(r: dict) -> list[str]:
    lines = ["Divided per rank:"]
    if not (r["divides"] or r["config_divides"]):
        lines.append("  (nothing)")
    for name, count, d in _grouped(r["divides"], "fqn", ("attr", "dense", "per_rank")):
        lines.append(f"  {name}.{d['attr']}: {d['dense']} -> {d['per_rank']}" + (f"  (x{count})" if count > 1 else ""))
    for d in r["config_divides"]:
        lines.append(f"  config.{d['name']}: {d['dense']} -> {d['per_rank']} (written back dense on save)")
    for d in r["divisible"]:
        lines.append(f"  config.{d['name']} = {d['value']}: checked divisible, not changed")
    return lines


def _head_lines(r: dict) -> list[str]:
    """The LM head and the loss, then the forward inputs sliced per rank's heads."""
    lines = []
    if r["lm_head"]:
        head = next(m for m in r["modules"] if m["fqn"] == r["lm_head"])
        pad = (f", vocab {head['vocab_size']} padded to {head['padded_size']}"
               if head["padded_size"] and head["padded_size"] != head["vocab_size"] else "")
        lines.append(f"LM head: {r['lm_head']} (colwise_rep{pad}; logits gathered, kept vocab-sharded with labels=)")
        if r["loss_kind"]:
            lines.append(f"loss: {r['loss_kind']} (vocab-parallel cross-entropy with labels=; "
                         f"{'divides' if r['honours_num_items'] else 'ignores'} num_items_in_batch)")
        else:
            lines.append("loss: none (HF's own loss on the gathered logits)")
    else:
        lines.append("LM head: none (no colwise_rep module); loss: HF's own, on gathered outputs")
    if r["head_inputs"]:
        lines += ["", "Forward inputs sliced to this rank's heads (one entry per head, built for all heads):"]
        for name, count, h in _grouped(r["head_inputs"], "fqn", ("argument", "dim", "dense_heads")):
            lines.append(f"  {name}: argument {h['argument']!r}, dim {h['dim']}: {h['dense_heads']} -> "
                         f"{h['per_rank']} heads" + (f"  (x{count})" if count > 1 else ""))
    return lines
