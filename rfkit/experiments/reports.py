"""What the experiments leave behind: report files, and their numbers on the cards of the
models they measured (:mod:`rfkit.conversion.evaluations`)."""

from __future__ import annotations

from pathlib import Path


def write_report(out: Path, stem: str, result: dict, table: str, draw, command: str | None = None) -> None:
    """``<stem>.json``, ``<stem>.md`` (``table``) and ``<stem>.png`` (``draw(result, path)``) in
    ``out``, each written whole; then the table and where the files are on screen."""
    from rfkit.atomic import atomic_write_json, atomic_write_text
    from rfkit.provenance import stamp

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / f"{stem}.json", stamp(result, command=command, wall_seconds=result.get("wall_seconds")))
    atomic_write_text(out / f"{stem}.md", table + "\n")
    draw(result, out / f"{stem}.png")
    print(table)
    print(f"\n{stem}.json, {stem}.md, {stem}.png -> {out}")


def record_trained(result: dict, command: str) -> None:
    """Each ``--trained`` model's card gets its rows beside the original and the training-free
    rows at its beta (:mod:`rfkit.conversion.evaluations`): the matched-cache comparison."""
    from rfkit.conversion.evaluations import add_to_model

    length = result["cache_length"]
    sets = {"ppl": f"perplexity, {result['val_blocks']} validation blocks of {result['seq_len']:,}"}
    sets.update({name: f"perplexity, {result['long']['blocks'][name]} blocks {name}" for name in result["original"].get("long_ppl", {})})
    measures = {**sets, "cache": f"cache bytes per token after {length:,} tokens"}

    def cells(row: dict) -> dict:
        values = {key: row["ppl"] if key == "ppl" else row["long_ppl"][key] for key in sets}
        return {**values, "cache": row["cache_bytes"] / length}

    for path in dict.fromkeys(r["model"] for r in result["rows"] if r.get("model")):
        mine = [r for r in result["rows"] if r.get("model") == path]
        columns = {"original": cells(result["original"])}
        for r in mine:
            columns["converted, state off" if r["operator"].endswith("state off") else "converted"] = cells(r)
        for r in result["rows"]:
            if not r.get("trained") and r["beta"] == mine[0]["beta"] and r["replaced_heads"]:
                columns[f"{r['operator']}, training-free"] = cells(r)
        rows = {measures[key]: {column: values[key] for column, values in columns.items()} for key in measures}
        formats = {label: (",.0f" if key == "cache" else ".3f") for key, label in measures.items()}
        key = f"sweep {Path(result['recipe']).name} val_blocks={result['val_blocks']} cache_length={length} long={result['long']}"
        title = f"Against training-free operators at the same beta ({mine[0]['beta']:g}; rfkit sweep)"
        add_to_model(path, key, title, rows, command, formats)


def bench_record(result: dict) -> tuple[str, str, dict, dict]:
    """``(key, title, rows, formats)`` of a bench result for the model card
    (:func:`rfkit.conversion.evaluations.record`): both models' numbers per length or context."""
    rows, formats = {}, {}
    if result["kind"] == "cache":
        prompt = result["rows"][0]["prompt_len"] if result["rows"] else 0
        key = f"bench cache prompt_len={prompt} device={result['device']}"
        title = f"KV cache bytes held after a {prompt}-token prompt and l_g generated tokens (rfkit bench cache)"
        for r in result["rows"]:
            measure = f"cache bytes, l_g {r['l_g']:,}"
            rows[measure] = {name: r[f"cache_bytes_{name}"] for name in ("original", "converted")}
            formats[measure] = ",.0f"
        return key, title, rows, formats
    key = f"bench speed runs={result['runs']} decode_tokens={result['decode_tokens']} device={result['device']} threads={result['threads']}"
    title = (
        f"Tokens per second, median of {result['runs']} runs on {result['device']} "
        f"({result['threads']} threads; rfkit bench speed)"
    )
    for r in result["rows"]:
        batch = r.get("batch", 1)
        for phase in ("prefill", "decode"):
            measure = f"{phase} tokens/s, {r['context']:,}-token context" + (f", batch {batch}" if batch != 1 else "")
            rows[measure] = {name: r[f"{phase}_tps_{name}"] for name in ("original", "converted")}
            formats[measure] = ".2f"
    return key, title, rows, formats
