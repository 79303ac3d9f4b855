# Sourced by device_env.sh and device_vllm.sh: the environment every Python process of the device
# scripts starts with (tests/test_device_scripts.py starts each Python entry point of the
# device_*.sh scripts under it, on the CPU). PYTHONSAFEPATH: scripts import the installed mpack,
# not the checkout beside them; it keeps a script's own folder off sys.path too, so each script
# puts that folder there itself (benchutil, bench_rt, bench_vt). $1, where given: PYTHONPATH
# (device_env.sh's $SITE, where mpack is installed).
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
if [ -n "${1:-}" ]; then export PYTHONPATH=$1; fi
