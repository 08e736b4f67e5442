#!/usr/bin/env bash
# Builds baleen's runtime image with podman from binaries built on this host, and runs it.
# No docker engine and no container registry is needed: the base, a debian:bookworm-slim
# equivalent, is made with debootstrap from the host's apt mirror.
#
#   cargo build --release --locked -p baleen-agent -p baleen-extender
#   sudo scripts/build-image.sh [BIN_DIR]
#
# Steps:
#   1. Strips copies of BIN_DIR/baleen-agent and BIN_DIR/baleen-extender (sizes before/after).
#   2. Makes the base: `debootstrap --variant=minbase bookworm` from the host's Debian mirror,
#      brought up to date from bookworm-updates and bookworm-security, slimmed the way the
#      official -slim images are (no docs but copyright files, man pages, locales, apt lists
#      or caches), tarred into the cache and `podman import`ed as localhost/baleen-base:bookworm.
#      The tarball is reused on later runs (BALEEN_REFRESH_BASE=1 makes a new one).
#   3. Builds packaging/docker/Containerfile.runtime (the Dockerfile's runtime stage) from a
#      context holding only the two stripped binaries: localhost/baleen:<workspace version>.
#   4. Runs `inventory --simulated /examples/h200-8x-nvswitch.yaml` (packaging/examples mounted
#      read-only at /examples) and `baleen-extender --help` in it; fails if either fails.
#      Prints the image's size.
#
# Needs root: debootstrap and chroot do, and the image goes into root's podman store
# (rootless podman is not tried). Debian/Ubuntu host; the binaries must link against a glibc
# no newer than bookworm's (2.36), i.e. be built on bookworm, as the Dockerfile's build stage is.
#
# Tools: podman, debootstrap (only while the base is not cached), runc (on hybrid cgroup hosts,
# see below), objcopy/strip (binutils). A missing one is an error naming its apt package; the
# script installs them with apt-get only when BALEEN_INSTALL_TOOLS=1 (a developer's
# machine is not changed behind their back).
#
# Environment (all optional):
#   BALEEN_BIN_DIR          the binaries' directory when no argument is given [target/release]
#   BALEEN_IMAGE_CACHE      where the base tarball (and the binaries' debug info) is kept
#                           [<repo>/.tools/image-cache; /.tools is git-ignored]
#   BALEEN_REFRESH_BASE=1   debootstrap a new base even when one is cached
#   BALEEN_DEBIAN_MIRROR    the Debian mirror [the host's apt source for bookworm, else
#                           http://deb.debian.org/debian]; BALEEN_SECURITY_MIRROR likewise for
#                           bookworm-security [host's, else http://deb.debian.org/debian-security]
#   BALEEN_BASE_IMAGE       the base's name in podman [localhost/baleen-base:bookworm]
#   BALEEN_IMAGE_NAME       the image's name, tagged :<version> [localhost/baleen]
#   BALEEN_STRIP            debug: `objcopy --strip-debug` (default), all: `strip --strip-all`
#   BALEEN_OCI_RUNTIME      the OCI runtime podman runs containers with [runc on hybrid cgroup
#                           hosts whose cgroup2 hierarchy has controllers, else podman's default]
#   BALEEN_PODMAN_STORAGE_DRIVER  podman --storage-driver (e.g. vfs where overlay cannot work,
#                           such as inside another container) [podman's default]
#   BALEEN_INSTALL_TOOLS=1  apt-get install the missing tools
#
# What podman needs on hosts like the CI VMs (Firecracker, cgroup v1 "hybrid", no systemd, root
# without CAP_SYS_RESOURCE), each found by running podman 4.3.1 (Debian bookworm) there:
#   --runtime runc: crun (Debian's default runtime) refuses to start any container, even with
#       --cgroups=disabled: "crun: cgroups in hybrid mode not supported, drop all controllers from
#       cgroupv2" (the hugetlb controller sits on /sys/fs/cgroup/unified). runc 1.1 handles hybrid.
#   --ulimit nofile=N:N --ulimit nproc=M:M: rootful podman asks for RLIMIT_NOFILE and RLIMIT_NPROC
#       of 1048576 in every container, and raising a hard limit needs CAP_SYS_RESOURCE: "crun:
#       setrlimit `RLIMIT_NOFILE`: Operation not permitted" / runc: "error setting rlimit type 7".
#       N is the host's hard nofile limit; M the host's hard nproc limit but at most 32768, since
#       podman lowers its own RLIMIT_NPROC to 32768 at start and the runtime inherits that.
#       Only passed when CAP_SYS_RESOURCE is missing.
#   --cgroup-manager=cgroupfs --events-backend=file: no systemd or journald (what podman picks
#       there anyway; said explicitly so a host with systemd behaves the same).
#   --network=none for runs: the checks need no network (and need no netavark/iptables).
#   --isolation=chroot for the build: the Containerfile has no RUN step, and chroot isolation
#       needs neither an OCI runtime nor cgroups (buildah 1.28 refuses --network with it).
#   --pull=never: the base is local; nothing is fetched from a registry.
#   The overlay storage driver works on ext4 (native diff); vfs is not needed.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin_dir=${1:-${BALEEN_BIN_DIR:-$repo/target/release}}
cache=${BALEEN_IMAGE_CACHE:-$repo/.tools/image-cache}
base_image=${BALEEN_BASE_IMAGE:-localhost/baleen-base:bookworm}
image_name=${BALEEN_IMAGE_NAME:-localhost/baleen}
strip_mode=${BALEEN_STRIP:-debug}
suite=bookworm
containerfile=$repo/packaging/docker/Containerfile.runtime
examples=$repo/packaging/examples

say() { printf '==> %s\n' "$*"; }
die() { printf 'build-image.sh: error: %s\n' "$*" >&2; exit 1; }
human() { numfmt --to=iec-i --suffix=B --format='%.1f' "$1"; }
elapsed() { echo "$(($(date +%s) - $1))s"; }

# ---- the binaries ---------------------------------------------------------------------------
for b in baleen-agent baleen-extender; do
    [[ -f $bin_dir/$b && -x $bin_dir/$b ]] || die "no executable $bin_dir/$b; build the binaries first:
    cargo build --release -p baleen-agent -p baleen-extender
or pass their directory: scripts/build-image.sh DIR (or BALEEN_BIN_DIR=DIR)"
done
case $strip_mode in debug | all) ;; *) die "BALEEN_STRIP must be debug or all, not '$strip_mode'" ;; esac
[[ -f $containerfile ]] || die "missing $containerfile"
[[ -f $examples/h200-8x-nvswitch.yaml ]] || die "missing $examples/h200-8x-nvswitch.yaml"
version=$(awk '/^\[/ { s = ($0 == "[workspace.package]") }
    s && /^version[ \t]*=/ { sub(/^[^"]*"/, ""); sub(/".*/, ""); print; exit }' "$repo/Cargo.toml")
[[ -n $version ]] || die "no [workspace.package] version in $repo/Cargo.toml"
image=$image_name:$version

[[ $EUID -eq 0 ]] || die "run as root (sudo): debootstrap and chroot need it, and the image goes into root's podman store"

# ---- the tools ------------------------------------------------------------------------------
# Hybrid cgroups (v1 controllers, and a cgroup2 hierarchy at /sys/fs/cgroup/unified that holds
# controllers of its own): crun cannot run containers there, runc can.
hybrid_v2_controllers() {
    [[ ! -e /sys/fs/cgroup/cgroup.controllers && -r /sys/fs/cgroup/unified/cgroup.controllers ]] &&
        grep -q '[a-z]' /sys/fs/cgroup/unified/cgroup.controllers
}
runtime=${BALEEN_OCI_RUNTIME:-}
if [[ -z $runtime ]] && hybrid_v2_controllers; then
    runtime=runc
    say "cgroups are hybrid with controllers on cgroup2 ($(paste -sd" " /sys/fs/cgroup/unified/cgroup.controllers)): using runc (crun refuses to start containers there)"
fi
base_tar=$cache/debian-$suite-minbase-slim-$(dpkg --print-architecture 2>/dev/null || uname -m).tar
need_base=0
[[ -f $base_tar && ${BALEEN_REFRESH_BASE:-0} != 1 ]] || need_base=1

missing=()   # "command:apt package"
need() { command -v "$1" >/dev/null 2>&1 || missing+=("$1:$2"); }
need podman podman
need objcopy binutils
need strip binutils
need numfmt coreutils
need tar tar
[[ $need_base -eq 0 ]] || { need debootstrap debootstrap; need chroot coreutils; need mountpoint util-linux; }
[[ -z $runtime ]] || need "$runtime" "$runtime"
if ((${#missing[@]})); then
    pkgs=$(printf '%s\n' "${missing[@]}" | cut -d: -f2 | sort -u | tr '\n' ' ')
    if [[ ${BALEEN_INSTALL_TOOLS:-0} == 1 ]]; then
        say "installing $pkgs(BALEEN_INSTALL_TOOLS=1)"
        # shellcheck disable=SC2086 # one word per package
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q $pkgs ||
            { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $pkgs; } ||
            die "apt-get install $pkgs failed"
    else
        for m in "${missing[@]}"; do
            printf 'build-image.sh: error: %s not found (apt package %s)\n' "${m%%:*}" "${m#*:}" >&2
        done
        die "install them with: apt-get install -y $pkgs(or rerun with BALEEN_INSTALL_TOOLS=1)"
    fi
fi

podman_global=(--cgroup-manager=cgroupfs --events-backend=file)
[[ -z $runtime ]] || podman_global+=(--runtime "$runtime")
[[ -z ${BALEEN_PODMAN_STORAGE_DRIVER:-} ]] || podman_global+=(--storage-driver "$BALEEN_PODMAN_STORAGE_DRIVER")
pm() { podman "${podman_global[@]}" "$@"; }

run_flags=(--rm --pull=never --network=none --security-opt label=disable)
# Bit 24 of the effective set: CAP_SYS_RESOURCE. Without it podman's default rlimits fail.
cap_eff=$(awk '/^CapEff:/ { print $2 }' /proc/self/status)
if (((0x$cap_eff >> 24 & 1) == 0)); then
    nofile=$(ulimit -Hn)
    [[ $nofile != unlimited ]] || nofile=$(cat /proc/sys/fs/nr_open)
    nproc=$(ulimit -Hu)
    [[ $nproc != unlimited && $nproc -le 32768 ]] || nproc=32768
    run_flags+=(--ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc")
    say "no CAP_SYS_RESOURCE: containers get the host's limits (nofile $nofile, nproc $nproc) instead of podman's 1048576"
fi

work=$(mktemp -d "${TMPDIR:-/var/tmp}/baleen-image.XXXXXX")
cleanup() {
    # Never delete a rootfs with /proc still mounted in it.
    if [[ -d $work/rootfs/proc ]] && mountpoint -q "$work/rootfs/proc"; then
        umount "$work/rootfs/proc" || { echo "build-image.sh: left $work (umount $work/rootfs/proc failed)" >&2; return; }
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# ---- 1. strip -------------------------------------------------------------------------------
# The release profile keeps line tables (Cargo.toml: debug = "line-tables-only") for backtraces
# with files and lines; most of a binary's size is that DWARF. BALEEN_STRIP=debug (the default)
# runs `objcopy --strip-debug`: drops the DWARF but keeps the symbol table, so a backtrace from
# the image still names every function. The DWARF is kept beside the cache
# (objcopy --only-keep-debug, linked with --add-gnu-debuglink) to symbolize such a backtrace's
# addresses with files and lines. BALEEN_STRIP=all runs `strip --strip-all`, which also drops
# the symbol table: smaller, but backtraces are bare addresses.
ctx=$work/context
debug_dir=$cache/debug/$version
mkdir -p "$ctx" "$debug_dir"
say "stripping the binaries from $bin_dir ($([[ $strip_mode == debug ]] && echo 'objcopy --strip-debug' || echo 'strip --strip-all'))"
for b in baleen-agent baleen-extender; do
    install -m 0755 "$bin_dir/$b" "$ctx/$b"
    before=$(stat -c %s "$ctx/$b")
    if [[ $strip_mode == debug ]]; then
        objcopy --only-keep-debug "$ctx/$b" "$debug_dir/$b.debug"
        (cd "$debug_dir" && objcopy --strip-debug --add-gnu-debuglink="$b.debug" "$ctx/$b")
    else
        strip --strip-all "$ctx/$b"
    fi
    after=$(stat -c %s "$ctx/$b")
    printf '    %-16s %10s -> %10s\n' "$b" "$(human "$before")" "$(human "$after")"
done
[[ $strip_mode != debug ]] || say "debug info kept in $debug_dir"

# ---- 2. the base ----------------------------------------------------------------------------
# The host's apt source for a suite (apt-get indextargets reads sources.list and
# sources.list.d/*, one-line and deb822 alike), else deb.debian.org's.
apt_site() {
    local site=
    # shellcheck disable=SC2016 # $(SITE) is apt's field, not the shell's
    command -v apt-get >/dev/null 2>&1 &&
        site=$(apt-get indextargets --format '$(SITE)' "Release: $1" 'Identifier: Packages' 2>/dev/null | head -n 1)
    echo "${site:-$2}"
}
if [[ $need_base -eq 1 ]]; then
    mirror=${BALEEN_DEBIAN_MIRROR:-$(apt_site "$suite" http://deb.debian.org/debian)}
    security=${BALEEN_SECURITY_MIRROR:-$(apt_site "$suite-security" http://deb.debian.org/debian-security)}
    updates=$(apt_site "$suite-updates" "$mirror")
    rootfs=${work:?}/rootfs
    t0=$(date +%s)
    say "debootstrap --variant=minbase $suite from $mirror (log: $work/debootstrap.log)"
    debootstrap --variant=minbase "$suite" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 ||
        { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed (the end of its log is above; is $mirror reachable?)"; }
    say "debootstrap took $(elapsed "$t0")"

    # Security and point updates, as the official image has them at its build date.
    t0=$(date +%s)
    printf 'deb %s %s main\ndeb %s %s main\n' "$updates" "$suite-updates" "$security" "$suite-security" \
        >"$rootfs/etc/apt/sources.list.d/updates.list"
    mount -t proc proc "$rootfs/proc"
    if ! { chroot "$rootfs" apt-get -q update && chroot "$rootfs" env DEBIAN_FRONTEND=noninteractive \
        apt-get -q -y upgrade; } >"$work/upgrade.log" 2>&1; then
        tail -n 30 "$work/upgrade.log" >&2
        die "apt-get upgrade in the new base failed"
    fi
    umount "$rootfs/proc"
    say "updates from $suite-updates and $suite-security: $(grep -Eo '^[0-9]+ upgraded' "$work/upgrade.log" || echo '? upgraded') in $(elapsed "$t0")"

    # Slim it like debuerreotype slims the official -slim images: dpkg keeps no docs (but the
    # copyright files), man pages, info or locales from now on, and those already there go.
    cat >"$rootfs/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
# Like debian:*-slim: no documentation, man pages or translations.
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
EOF
    find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
    find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
    rm -rf "${rootfs:?}"/usr/share/{groff,info,linda,locale,man}/* "${rootfs:?}"/usr/share/lintian/overrides/*
    # As in the official images: apt cleans up after itself, services never start at install.
    cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
    printf 'Acquire::Languages "none";\n' >"$rootfs/etc/apt/apt.conf.d/docker-no-languages"
    printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d" && chmod 0755 "$rootfs/usr/sbin/policy-rc.d"
    # The official image's sources (the mirror used here may be a host-local one).
    rm -f "$rootfs/etc/apt/sources.list" "$rootfs/etc/apt/sources.list.d/updates.list"
    cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: http://deb.debian.org/debian
Suites: $suite $suite-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: $suite-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    # Nothing of this host or of the bootstrap: device nodes, DNS, hostname, lists, caches, logs.
    rm -rf "${rootfs:?}"/dev/* "${rootfs:?}"/tmp/* "${rootfs:?}"/var/tmp/* "${rootfs:?}"/var/lib/apt/lists/* \
        "${rootfs:?}"/var/cache/apt/archives/*.deb "${rootfs:?}"/var/cache/apt/*.bin \
        "${rootfs:?}"/var/cache/debconf/*-old "${rootfs:?}"/var/lib/dpkg/*-old "${rootfs:?}"/var/log/bootstrap.log \
        "$rootfs/etc/resolv.conf" "$rootfs/etc/machine-id"
    : >"$rootfs/etc/hostname"
    find "$rootfs/var/log" -type f -exec truncate -s 0 {} +
    mkdir -p "$cache"
    tar -C "$rootfs" --numeric-owner --xattrs -cf "$base_tar.new" .
    mv "$base_tar.new" "$base_tar"
    printf 'suite=%s\nmirror=%s\nsecurity=%s\ncreated=%s\n' "$suite" "$mirror" "$security" "$(date -u +%FT%TZ)" >"$base_tar.info"
    rootfs_size=$(du -sb "$rootfs" | cut -f1)
    say "base: $(human "$rootfs_size") unpacked, cached as $base_tar"
else
    say "base: cached $base_tar ($(grep -h '^created=' "$base_tar.info" 2>/dev/null || echo 'created=?'); BALEEN_REFRESH_BASE=1 makes a new one)"
fi

# Imported only when the cached tarball is not the one the base image was made from.
base_sum=$(sha256sum "$base_tar" | cut -d' ' -f1)
have_sum=$(pm image inspect --format '{{index .Config.Labels "io.baleen.base.sha256"}}' "$base_image" 2>/dev/null || true)
if [[ $have_sum != "$base_sum" ]]; then
    t0=$(date +%s)
    pm import --quiet \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["bash"]' \
        --change "LABEL io.baleen.base.sha256=$base_sum" \
        "$base_tar" "$base_image" >/dev/null
    say "imported $base_image in $(elapsed "$t0")"
else
    say "$base_image is already the cached base"
fi

# ---- 3. the image ---------------------------------------------------------------------------
t0=$(date +%s)
revision=$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)
say "building $image from $containerfile"
# Built untagged; tagged only once both checks below have passed, so a failed run never leaves
# $image naming an image that does not work.
pm build --pull=never --isolation=chroot --iidfile "$work/iid" \
    --build-arg "BASE_IMAGE=$base_image" \
    --label "org.opencontainers.image.version=$version" \
    --label "org.opencontainers.image.revision=$revision" \
    -f "$containerfile" "$ctx"
iid=$(cat "$work/iid")
say "built ${iid#sha256:} in $(elapsed "$t0")"

# ---- 4. run it ------------------------------------------------------------------------------
say "podman run <image> inventory --simulated /examples/h200-8x-nvswitch.yaml"
pm run "${run_flags[@]}" -v "$examples:/examples:ro" "$iid" \
    inventory --simulated /examples/h200-8x-nvswitch.yaml ||
    die "the agent's inventory failed in the new image (${iid#sha256:}; $image left as it was)"
say "podman run --entrypoint /usr/local/bin/baleen-extender <image> --help"
pm run "${run_flags[@]}" --entrypoint /usr/local/bin/baleen-extender "$iid" --help ||
    die "baleen-extender --help failed in the new image (${iid#sha256:}; $image left as it was)"
pm tag "$iid" "$image"

size=$(pm image inspect --format '{{.Size}}' "$image")
base_size=$(pm image inspect --format '{{.Size}}' "$base_image")
say "$image: $(human "$size") ($(human "$base_size") of it the base)"
