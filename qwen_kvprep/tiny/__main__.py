"""`python -m qwen_kvprep.tiny DEST`: write a tiny Qwen v1 checkpoint by hand."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from qwen_kvprep.errors import KvprepError
from qwen_kvprep.tiny import DTYPES, generate_checkpoint


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qwen_kvprep.tiny", description=__doc__)
    parser.add_argument("dest", type=Path, help="folder to create (absent or empty)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--vocab-merges", type=int, default=256)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--dtype", choices=DTYPES, help="default bf16; fp16 with --gptq")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--legacy-bin", action="store_true", help="one pytorch_model.bin")
    parser.add_argument(
        "--gptq", action="store_true", help="a GPTQ Int4 checkpoint, as Qwen's -Int4 repos ship"
    )
    parser.add_argument("--kernel-sources", type=Path, help="folder with the two kernel files")
    args = parser.parse_args(argv)
    # Each option's dest is generate_checkpoint's parameter of the same name.
    options = vars(args)
    try:
        dest = generate_checkpoint(options.pop("dest"), **options)
    except KvprepError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
