"""Fill the values you chose (deploy/values.env, or the environment) into deploy/'s files.

    python deploy/render.py                      # every file whose values are set -> deploy/rendered/
    python deploy/render.py --out DIR FILE...    # only these files

Only ${RAYSHARD_*} placeholders are replaced, so shell variables such as $RAY_HEAD_IP in the
launcher's commands pass through untouched. A file that needs a value still empty is skipped
with a message naming the value; a value that cannot be right (an account id that is not 12
digits, a bucket name S3 would refuse) is an error. Standard library only: it runs wherever
`ray` or `kubectl` does.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
PLACEHOLDER = re.compile(r"\$\{(RAYSHARD_[A-Z0-9_]+)\}")
TEMPLATE_SUFFIXES = (".yaml", ".json", ".env")
NOT_TEMPLATES = {"values.env"}

# What a value must look like; the message says how to fix it.
FORMATS = {
    "RAYSHARD_AWS_ACCOUNT_ID": (r"\d{12}", "a 12-digit AWS account id, e.g. 123456789012"),
    "RAYSHARD_AWS_REGION": (r"[a-z]{2}(-[a-z]+)+-\d", "an AWS region name, e.g. us-east-1"),
    "RAYSHARD_BUCKET": (r"(?!xn--)(?!.*-s3alias$)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]",
                        "an S3 bucket name: 3-63 lowercase letters, digits, dots and hyphens"),
    "RAYSHARD_IMAGE_REGISTRY": (r"[a-z0-9.-]+(:\d+)?(/[a-z0-9._-]+)*",
                                "a registry host and optional path, no image name or tag, "
                                "e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com"),
    "RAYSHARD_AMI": (r"ami-[0-9a-f]{8,17}", "an AMI id, e.g. ami-0123456789abcdef0"),
    "RAYSHARD_EKS_CLUSTER": (r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}", "an EKS cluster name"),
    "RAYSHARD_AZURE_SUBSCRIPTION_ID": (r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
                                       "an Azure subscription id (a GUID), e.g. 00000000-1111-2222-3333-444444444444"),
    "RAYSHARD_AZURE_RESOURCE_GROUP": (r"[-\w.()]{0,89}[-\w()]", "an Azure resource group name, e.g. ml-prod"),
    "RAYSHARD_AZURE_STORAGE_ACCOUNT": (r"[a-z0-9]{3,24}", "a storage account name: 3-24 lowercase letters and digits"),
    "RAYSHARD_AZURE_CONTAINER": (r"(?!.*--)[a-z0-9][a-z0-9-]{1,61}[a-z0-9]",
                                 "a blob container name: 3-63 lowercase letters, digits and single hyphens"),
}


def read_values(path: Path = DEPLOY / "values.env", environ=os.environ) -> dict[str, str]:
    """NAME=value lines of values.env, overridden by RAYSHARD_* variables in the environment."""
    values = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep or not name.startswith("RAYSHARD_"):
            raise SystemExit(f"{path}:{number}: expected RAYSHARD_NAME=value, got {line!r}")
        values[name] = value.strip()
    values.update({k: v for k, v in environ.items() if k.startswith("RAYSHARD_") and k in values})
    for name, value in values.items():
        pattern, what = FORMATS.get(name, (r".*", ""))
        if value and not re.fullmatch(pattern, value):
            raise SystemExit(f"{name}={value!r} is not {what}: fix it in {path} or in the environment")
    return values


def templates() -> list[Path]:
    return sorted(p for p in DEPLOY.iterdir()
                  if p.is_file() and p.suffix in TEMPLATE_SUFFIXES and p.name not in NOT_TEMPLATES)


def placeholders(text: str) -> set[str]:
    return set(PLACEHOLDER.findall(text))


def render_text(text: str, values: dict[str, str]) -> str:
    missing = sorted(name for name in placeholders(text) if not values.get(name))
    if missing:
        raise KeyError(", ".join(missing))
    return PLACEHOLDER.sub(lambda match: values[match.group(1)], text)


def render(out: Path, values: dict[str, str], names: list[str] | None = None) -> tuple[list[Path], list[str]]:
    """Write the rendered files to out; return (written paths, 'file: missing values' notes)."""
    chosen = [DEPLOY / name for name in names] if names else templates()
    out.mkdir(parents=True, exist_ok=True)
    written, skipped = [], []
    for source in chosen:
        try:
            text = render_text(source.read_text(), values)
        except KeyError as missing:
            skipped.append(f"{source.name}: set {missing.args[0]} in deploy/values.env")
            continue
        target = out / source.name
        target.write_text(text)
        written.append(target)
    return written, skipped


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="file names in deploy/ (default: all)")
    parser.add_argument("--values", type=Path, default=DEPLOY / "values.env")
    parser.add_argument("--out", type=Path, default=DEPLOY / "rendered")
    args = parser.parse_args(argv)
    written, skipped = render(args.out, read_values(args.values), args.files or None)
    for path in written:
        print(f"rendered {path}")
    for note in skipped:
        print(f"skipped  {note}", file=sys.stderr)
    return 1 if skipped and args.files else 0


if __name__ == "__main__":
    sys.exit(main())
