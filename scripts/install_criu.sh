#!/usr/bin/env bash
# Installs CRIU >= 4 for the `criu` sandbox backend (envs/sandbox/criu.py), building it from
# Debian trixie's source package on a bookworm machine.
#
# Why build: bookworm's criu 3.17 fails `criu check` on recent kernels (vDSO layout), and every
# CRIU release up to 4.1.1 fails to dump a process holding an AF_INET/AF_INET6 socket on Linux
# >= 6.16 (SO_PASSCRED/SO_PASSSEC became unix/netlink-only, getsockopt returns EOPNOTSUPP). The
# build applies a small patch of ours for the latter.
#
# Idempotent: if a criu >= 4 on PATH passes `criu check` and can dump a process that holds an
# AF_INET socket, it does nothing. Otherwise it builds and installs $PREFIX/sbin/criu. Needs root
# (apt-get, and CRIU itself runs as root). Prints what it did.
#
# Usage: sudo bash scripts/install_criu.sh      (CI calls it before the tests)
# Env:   CRIU_PREFIX (default /usr/local), CRIU_BUILD_DIR (default /var/tmp/bpo-criu-build),
#        CRIU_FORCE_BUILD=1 to rebuild even when a working criu is found.
set -euo pipefail

PREFIX="${CRIU_PREFIX:-/usr/local}"
BUILD_DIR="${CRIU_BUILD_DIR:-/var/tmp/bpo-criu-build}"
MIN_MAJOR=4
SOURCES_FILE=/etc/apt/sources.list.d/bpo-trixie-src.sources
# Where CRIU keeps its kernel-feature cache when /run is not a tmpfs; envs/sandbox/criu.py knows
# this path too (KDAT_DIR there).
KDAT_DIR=/dev/shm/criu-kdat
# The patch marker: a string the patched sockets.c contains.
PATCH_MARKER="bpo-sockopt-6.16"

log() { echo "install_criu: $*"; }
die() {
  echo "install_criu: ERROR: $*" >&2
  exit 1
}

is_tmpfs() { [ "$(stat -f -c %T "$1" 2>/dev/null)" = tmpfs ]; }

# Prints the major version of the criu binary $1 (empty if it does not run).
criu_major() {
  "$1" --version 2>/dev/null | sed -n 's/^Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n1
}

# Dumps (leaving it running) a throwaway process that holds an AF_INET socket: the dump that
# unpatched CRIU fails on Linux >= 6.16. Returns criu's status; prints its errors on failure.
probe_inet_dump() {
  local criu="$1" dir pid rc=0
  dir="$(mktemp -d)"
  setsid python3 -c 'import socket, time; s = socket.socket(); time.sleep(60)' \
    </dev/null >/dev/null 2>&1 &
  pid=$!
  sleep 0.3
  "$criu" dump -t "$pid" -D "$dir" --leave-running -o dump.log >/dev/null 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    grep -E 'Error|Warn' "$dir/dump.log" | tail -n 5 >&2 || true
  fi
  kill -9 "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  rm -rf "$dir"
  return "$rc"
}

# Succeeds if $1 is a criu >= MIN_MAJOR that passes `criu check` and the AF_INET dump probe.
is_working_criu() {
  local criu="$1" major out
  major="$(criu_major "$criu")"
  if [ -z "$major" ] || [ "$major" -lt "$MIN_MAJOR" ]; then
    log "$criu is version '${major:-unknown}', need >= $MIN_MAJOR."
    return 1
  fi
  if ! out="$("$criu" check 2>&1)"; then
    log "'$criu check' failed: $out"
    return 1
  fi
  if ! probe_inet_dump "$criu"; then
    log "$criu cannot dump a process holding an AF_INET socket (unpatched for Linux >= 6.16?)."
    return 1
  fi
  return 0
}

[ "$(id -u)" -eq 0 ] || die "run as root (it installs packages and CRIU needs root); uid is $(id -u)."

if [ "${CRIU_FORCE_BUILD:-0}" != 1 ] && existing="$(command -v criu)"; then
  if is_working_criu "$existing"; then
    log "nothing to do: $existing ($("$existing" --version | head -n1)) passes 'criu check' and" \
      "dumps AF_INET sockets."
    if ! { is_tmpfs /run && [ -f /run/criu.kdat ]; } && [ ! -f "$KDAT_DIR/criu.kdat" ]; then
      log "note: this criu keeps no kernel-feature cache (/run is not a tmpfs), so every call" \
        "costs ~0.15 s more; CRIU_FORCE_BUILD=1 rebuilds it with the cache in $KDAT_DIR."
    fi
    exit 0
  fi
  log "found $existing but it is not usable; building CRIU from trixie's source."
elif [ "${CRIU_FORCE_BUILD:-0}" = 1 ]; then
  log "CRIU_FORCE_BUILD=1: building CRIU from trixie's source."
else
  log "no criu on PATH; building CRIU from trixie's source."
fi

export DEBIAN_FRONTEND=noninteractive

# 1. Source package from trixie. Only a deb-src entry is added, so no trixie binary package can
#    ever be installed from it.
if [ ! -f "$SOURCES_FILE" ]; then
  log "adding trixie deb-src entry $SOURCES_FILE"
  cat >"$SOURCES_FILE" <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
fi
log "apt-get update"
apt-get update -qq || die "apt-get update failed."

# 2. Build dependencies, from bookworm. The packaging's full Build-Depends also wants docs and
#    test tooling; the `criu` binary needs only these.
log "installing build dependencies from bookworm"
apt-get install -y -qq --no-install-recommends \
  gcc make pkg-config patch xz-utils python3 python3-protobuf \
  libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler \
  libnl-3-dev libnet1-dev libcap-dev libbsd-dev libnftables-dev libgnutls28-dev uuid-dev \
  iproute2 iptables >/dev/null || die "apt-get install of the build dependencies failed."

mkdir -p "$BUILD_DIR"
cd "$BUILD_DIR"
# The only deb-src entry is trixie's, so the newest source version apt knows is trixie's.
version="$(apt-cache showsrc criu 2>/dev/null | sed -n 's/^Version: *//p' | sort -V | tail -n1 || true)"
upstream="${version%-*}"
[ -n "$upstream" ] || die "apt knows no trixie source package for criu (apt-cache showsrc criu)."
src_dir="$BUILD_DIR/criu-$upstream"
if [ ! -d "$src_dir" ]; then
  log "fetching criu $version source (apt-get source criu/trixie)"
  # Some mirrors serve only the upstream tarball (the .dsc and the Debian tarball 404). apt has
  # checked the tarball's hash against the signed Sources index before keeping it, so unpacking
  # it directly is as safe; the Debian packaging is not needed to build the binary.
  if ! apt-get source -qq criu/trixie >/dev/null 2>&1; then
    [ -f "criu_${upstream}.orig.tar.xz" ] ||
      die "apt-get source criu/trixie failed and fetched no criu_${upstream}.orig.tar.xz."
    log "apt-get source could not fetch the Debian packaging; unpacking the upstream tarball"
    tar xf "criu_${upstream}.orig.tar.xz"
  fi
fi
[ -d "$src_dir" ] || die "expected the unpacked source at $src_dir."

# 3. Our patch for Linux >= 6.16 (skipped if already applied or if upstream has its own fix).
if grep -q "$PATCH_MARKER" "$src_dir/criu/sockets.c"; then
  log "socket-option patch already applied"
elif ! grep -q 'dump_opt(sk, SOL_SOCKET, SO_PASSCRED, &val);' "$src_dir/criu/sockets.c"; then
  log "this CRIU reads SO_PASSCRED differently; assuming upstream fixed it, not patching"
else
  log "applying the socket-option patch for Linux >= 6.16"
  patch -d "$src_dir" -p1 --forward --quiet <<'EOF'
--- a/criu/sockets.c
+++ b/criu/sockets.c
@@ -637,6 +637,25 @@
 	return 0;
 }
 
+/* Dumps a boolean SOL_SOCKET option that only some socket families support (bpo-sockopt-6.16). */
+static int dump_family_opt(int sk, int name, protobuf_c_boolean *has, protobuf_c_boolean *on)
+{
+	socklen_t len = sizeof(int);
+	int val = 0;
+
+	*has = false;
+	*on = false;
+	if (getsockopt(sk, SOL_SOCKET, name, &val, &len) < 0) {
+		if (errno == EOPNOTSUPP)
+			return 0;
+		pr_perror("Can't get %d:%d opt", SOL_SOCKET, name);
+		return -1;
+	}
+	*has = true;
+	*on = val ? true : false;
+	return 0;
+}
+
 int dump_socket_opts(int sk, SkOptsEntry *soe)
 {
 	int ret = 0, val;
@@ -676,13 +695,13 @@
 	soe->so_reuseport = val ? true : false;
 	soe->has_so_reuseport = true;
 
-	ret |= dump_opt(sk, SOL_SOCKET, SO_PASSCRED, &val);
-	soe->has_so_passcred = true;
-	soe->so_passcred = val ? true : false;
-
-	ret |= dump_opt(sk, SOL_SOCKET, SO_PASSSEC, &val);
-	soe->has_so_passsec = true;
-	soe->so_passsec = val ? true : false;
+	/*
+	 * Since Linux 6.16 only unix, netlink and bluetooth sockets have SO_PASSCRED and
+	 * SO_PASSSEC; reading them elsewhere fails with EOPNOTSUPP. Such sockets cannot have them
+	 * set, so they are recorded as absent rather than failing the dump.
+	 */
+	ret |= dump_family_opt(sk, SO_PASSCRED, &soe->has_so_passcred, &soe->so_passcred);
+	ret |= dump_family_opt(sk, SO_PASSSEC, &soe->has_so_passsec, &soe->so_passsec);
 
 	ret |= dump_opt(sk, SOL_SOCKET, SO_DONTROUTE, &val);
 	soe->has_so_dontroute = true;
EOF
fi

# 4. Build and install the binary. CRIU caches its kernel-feature probe (~0.15 s per call) in
#    $RUNDIR/criu.kdat, but only on a tmpfs; where /run is not one, use a root-only folder on
#    /dev/shm (the sandbox backend re-creates it after a reboot).
rundir=/run
if ! is_tmpfs /run; then
  rundir="$KDAT_DIR"
  log "/run is not a tmpfs: CRIU will keep its kernel-feature cache in $rundir"
fi
log "building criu $upstream in $src_dir (a few minutes on 2 cores)"
touch "$src_dir/criu/kerndat.c" # RUNDIR is compiled into kerndat.o only.
make -C "$src_dir" -j"$(nproc)" criu RUNDIR="$rundir" >"$BUILD_DIR/build.log" 2>&1 ||
  die "build failed; last lines of $BUILD_DIR/build.log: $(tail -n 20 "$BUILD_DIR/build.log")"
install -D -m 0755 "$src_dir/criu/criu" "$PREFIX/sbin/criu"
[ "$rundir" = /run ] || install -d -m 0700 "$rundir"
log "installed $PREFIX/sbin/criu ($("$PREFIX/sbin/criu" --version | head -n1))"

# 5. Verify with the binary just installed, whatever PATH says.
is_working_criu "$PREFIX/sbin/criu" ||
  die "the freshly built $PREFIX/sbin/criu does not work on this kernel ($(uname -r))."
resolved="$(command -v criu || true)"
if [ "$resolved" != "$PREFIX/sbin/criu" ]; then
  log "WARNING: 'criu' on PATH is '${resolved:-nothing}', not $PREFIX/sbin/criu; put" \
    "$PREFIX/sbin first on PATH or set BPO_CRIU=$PREFIX/sbin/criu."
fi
log "done: $PREFIX/sbin/criu passes 'criu check' and dumps AF_INET sockets."
