#!/usr/bin/env bash
# Copy the Transformer Engine kit (te_site.tar.xz + SHA256SUMS, ~27 MB: TE 2.20.2 pruned to
# sm_90 with its torch extension prebuilt for torch 2.11.0+cu130 / Python 3.12, megatron-core
# 0.19.2, pydantic) into the ignored .tekit/ of this checkout, verified, for the device tool to
# carry: run(command="bash tools/gpu_checks.sh", carry=[".tekit"], timeout_s=600).
#
#   bash tools/fetch_gpu_kit.sh [KIT_DIR]     # default: ../shared/gpu_kit beside the checkout
#   bash tools/fetch_gpu_kit.sh --help        # this text
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; exit 0 ;;  # the header
  -*) echo "usage: bash tools/fetch_gpu_kit.sh [KIT_DIR | --help]; got '$1'" >&2; exit 2 ;;
esac
if [ "$#" -gt 1 ]; then
  echo "usage: bash tools/fetch_gpu_kit.sh [KIT_DIR | --help]; got $# arguments" >&2; exit 2
fi
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
src="${1:-$repo/../shared/gpu_kit}"
for f in te_site.tar.xz SHA256SUMS; do
  [ -f "$src/$f" ] || { echo "fetch_gpu_kit: $src/$f not found (pass the kit folder as the first argument)" >&2; exit 2; }
done
dst="$repo/.tekit"
tmp="$(mktemp -d "$repo/.tekit.tmp.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
cp "$src/te_site.tar.xz" "$src/SHA256SUMS" "$tmp/"
(cd "$tmp" && sha256sum -c --quiet SHA256SUMS)
rm -rf "$dst"
mv "$tmp" "$dst"
trap - EXIT
git -C "$repo" check-ignore -q "$dst" || { echo "fetch_gpu_kit: .tekit/ is not ignored by git" >&2; exit 1; }
echo "kit in $dst ($(du -sh "$dst" | cut -f1)), checksum OK"
