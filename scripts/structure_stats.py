"""Figures of the package's structure, for the restructuring's before/after (issue 33).

Usage: python scripts/structure_stats.py [TREE]   (TREE: a checkout, default this one)

Prints: files over 600 lines; the five longest functions; the places a style's name is compared
outside the style classes (a string constant naming a style inside a comparison or a membership
test); the places that read ``tp_info`` directly outside tpify/info.py; README lines; the share of
docstring lines in tpify/.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

STYLE_NAMES = {"colwise", "rowwise", "packed_colwise", "colwise_rep", "embedding_rowwise", "embedding_colwise",
               "replicate", "replicate_sum_grads", "experts", "latent", "per_head"}  # tpify's, and HF's of the same name


def _style_modules(path: Path) -> bool:
    return path.name == "styles.py" or "styles" in path.parts[:-1]


def main(tree: Path) -> None:
    files = sorted((tree / "tpify").rglob("*.py"))
    long_files, functions, style_compares, tp_info_reads = [], [], [], []
    doc_lines = total_lines = 0
    for path in files:
        text = path.read_text()
        rel = path.relative_to(tree)
        n = len(text.splitlines())
        total_lines += n
        if n > 600:
            long_files.append((n, str(rel)))
        tree_ast = ast.parse(text)
        for node in ast.walk(tree_ast):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node, clean=False)
                if doc is not None and node.body and isinstance(node.body[0], ast.Expr):
                    first = node.body[0]
                    doc_lines += first.end_lineno - first.lineno + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
            if isinstance(node, ast.Compare) and not _style_modules(rel):
                consts = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in STYLE_NAMES]
                if consts:
                    style_compares.append(f"{rel}:{node.lineno}")
            if path.name != "info.py":
                if isinstance(node, ast.Attribute) and node.attr == "tp_info":
                    tp_info_reads.append(f"{rel}:{node.lineno}")
                elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
                      and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                      and node.args[1].value == "tp_info"):
                    tp_info_reads.append(f"{rel}:{node.lineno}")
    print(f"files over 600 lines: {len(long_files)}")
    for n, name in sorted(long_files, reverse=True):
        print(f"  {n:5d} {name}")
    print("five longest functions:")
    for n, name in sorted(functions, reverse=True)[:5]:
        print(f"  {n:5d} {name}")
    print(f"style names compared outside the style classes: {len(style_compares)}")
    for where in style_compares:
        print(f"  {where}")
    print(f"direct reads of tp_info outside tpify/info.py: {len(tp_info_reads)}")
    for where in tp_info_reads:
        print(f"  {where}")
    readme = tree / "README.md"
    print(f"README lines: {len(readme.read_text().splitlines())}")
    print(f"docstring lines: {doc_lines} of {total_lines} ({100 * doc_lines / total_lines:.1f}%)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
