# Shared by scripts/setup_env.sh and scripts/test_compat.sh (sourced, not run).

# One build at a time per checkout: both scripts install the package editable,
# which rebuilds the in-tree C extension the other venv uses too.
take_setup_lock() {
    if command -v flock >/dev/null 2>&1; then
        exec 9>"${TMPDIR:-/tmp}/shardformer-setup-$(pwd | sha256sum | cut -c1-16).lock"
        flock 9
    fi
}

# pip's own noise: this machine's pip configuration names index and find-links
# folders (some may not exist), and "already satisfied" lines say nothing new.
quiet_pip() {
    grep -v -e "^WARNING: Location '.*' is ignored" -e '^Requirement already satisfied' \
        -e '^Looking in indexes:' -e '^Looking in links:' || true
}
