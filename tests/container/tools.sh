# Shared by the container scripts: buildah, podman and runc from Debian's
# packages (installed when missing, as root), on the vfs storage driver,
# which needs no overlay mounts inside a sandbox.
buildah() { command buildah --storage-driver vfs "$@"; }
# Without systemd, podman cannot schedule health checks (`podman healthcheck
# run` runs them) and says so on every start and stop: that line is dropped.
podman() { command podman --storage-driver vfs "$@" 2> >(grep -v "systemd connection" >&2); }

apt_install() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || {
    echo "container: install $* (Debian: apt-get install $*)" >&2
    exit 1
  }
  echo "container: apt-get install $*" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null 2>&1 ||
    { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null; }
}

missing=""
for tool in buildah podman runc; do command -v $tool >/dev/null || missing="$missing $tool"; done
[ -z "$missing" ] || apt_install $missing
