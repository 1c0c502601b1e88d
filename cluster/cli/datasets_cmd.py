"""`vgrpo data check SPEC`: read a prompt set or I2V dataset the way a run will, report every defect."""

from __future__ import annotations

from common.config import load_config


def register(sub) -> None:
    p = sub.add_parser("data", help="check a prompt set or image-to-video dataset",
                       description="Datasets: a JSONL manifest, a folder of NAME.png + NAME.txt, a "
                       "prompts file or a built-in set (docs/datasets.md).")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    chk = dsub.add_parser("check", help="read every row and decode every image; one line per defect, exit 2",
                          description="Read SPEC as `train.prompts` would: decode every image, print one "
                          "line per defect and exit 2, or print the rows' count and exit 0.")
    chk.add_argument("spec", help="a .jsonl manifest, an image folder, a prompts file or a built-in set")
    chk.add_argument("--height", type=int, default=None, help="also fit each image to HEIGHT × WIDTH")
    chk.add_argument("--width", type=int, default=None)
    chk.add_argument("-c", "--config", default=None,
                     help="take the bounds (data.max_file_bytes, data.max_line_bytes, data.max_prompts) from CONFIG")
    chk.set_defaults(func=cmd_check)


def cmd_check(args) -> int:
    # lazy: torch, PIL (kept out of vgrpo --help)
    from cluster.data.prompts import load_prompts
    from common.images import condition_image

    conds = load_prompts(args.spec, load_config(args.config).data)
    with_image = sum(c.is_i2v for c in conds)
    if args.height and args.width:
        for c in conds:
            condition_image(c, args.height, args.width)
    print(f"{args.spec}: {len(conds)} conditions, {with_image} with a first frame")
    return 0
