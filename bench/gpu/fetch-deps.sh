#!/usr/bin/env bash
# bench/gpu/fetch-deps.sh — run HERE (Debian 12), before a GPU check: downloads the
# Debian packages ferry builds and tests against into .gpu-deps/ (ignored by git), for
# the device machine, whose image has CUDA, gcc and meson but maybe not these
# libraries. Name .gpu-deps in the device call's carry list; check.sh unpacks them into
# a private root when the machine lacks them. The C runtime, gcc's libraries,
# libffi, pcre2 and OpenSSL are left to the machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude=$(git rev-parse --git-path info/exclude) # a worktree's .git is a file
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu-deps/' "$exclude" 2>/dev/null || echo '/.gpu-deps/' >> "$exclude"
mkdir -p .gpu-deps
cd .gpu-deps
apt-get download \
    libopenblas-openmp-dev libopenblas0-openmp libgfortran5 libquadmath0 \
    libcjson-dev libcjson1 libjemalloc-dev libjemalloc2 libnuma-dev libnuma1 \
    libcriterion-dev libcriterion3 libboxfort-dev libgit2-1.5 libnanomsg5 \
    libhttp-parser2.9 libmbedtls14 libmbedx509-1 libmbedcrypto7 libssh2-1 zlib1g-dev zlib1g \
    pkgconf pkgconf-bin libpkgconf3
du -sh .
