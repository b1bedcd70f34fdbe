#!/usr/bin/env bash
# Builds Sluice's image from an unpacked release tarball (`make dist`):
#   tests/container/build-image.sh target/tarball/sluice-VERSION-TARGET sluice:VERSION
# with Docker when an engine answers, else with buildah (Debian's package,
# installed here when missing and running as root), daemonless, on the vfs
# storage driver. The base is debian:bookworm-slim; where no registry is
# reachable, a bookworm base is made locally with debootstrap instead
# (SLUICE_IMAGE_BASE names another base).
set -euo pipefail
CONTEXT=${1:?usage: build-image.sh DIST_DIR TAG}
TAG=${2:?usage: build-image.sh DIST_DIR TAG}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BASE=${SLUICE_IMAGE_BASE:-debian:bookworm-slim}
DOCKERFILE="$CONTEXT/packaging/container/Dockerfile"
test -f "$DOCKERFILE" || { echo "build-image: $DOCKERFILE missing (run make dist)" >&2; exit 1; }

if docker info >/dev/null 2>&1; then
  exec docker build --build-arg "BASE=$BASE" -f "$DOCKERFILE" -t "$TAG" "$CONTEXT"
fi

# shellcheck source=tests/container/tools.sh
. "$ROOT/tests/container/tools.sh"

if ! buildah images --quiet "$BASE" >/dev/null 2>&1 && ! buildah pull --quiet "$BASE" >/dev/null 2>&1; then
  LOCAL_BASE=localhost/sluice-base:bookworm
  if ! buildah images --quiet "$LOCAL_BASE" >/dev/null 2>&1; then
    echo "build-image: cannot pull $BASE; making $LOCAL_BASE with debootstrap" >&2
    command -v debootstrap >/dev/null || apt_install debootstrap
    ROOTFS=$(mktemp -d)
    chmod 755 "$ROOTFS" # becomes the image's /
    trap 'rm -rf "$ROOTFS"' EXIT
    debootstrap --variant=minbase --include=ca-certificates bookworm "$ROOTFS" http://deb.debian.org/debian >/dev/null
    rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/*
    tar -C "$ROOTFS" -c . | podman import --quiet \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$LOCAL_BASE" >/dev/null
  fi
  BASE=$LOCAL_BASE
fi

# --format docker: an OCI image has no HEALTHCHECK.
buildah bud --quiet --format docker --isolation chroot --build-arg "BASE=$BASE" \
  -f "$DOCKERFILE" -t "$TAG" "$CONTEXT" >/dev/null
echo "build-image: $TAG on $BASE ($(podman image inspect --format '{{.Size}}' "$TAG") bytes)"
