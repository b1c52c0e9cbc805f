# Two commands for a newcomer: `make demo` (the main job) and `make test` (the test suite).
# Both create .venv and install what they need on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYVER := $(shell $(PYTHON) -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')

.PHONY: install demo test down clean gpu-pack

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[export,test]'
	@# NVIDIA perf_analyzer, the independent load generator (`tritonctl load --tool perf_analyzer`): the binary
	@# of the last tritonclient wheel that ships one, apart from the package's own (newer) tritonclient.
	$(BIN)/pip install -q --no-deps --target $(VENV)/perf-analyzer tritonclient==2.41.1
	@# The Triton Python backend stub links the system libpython of the same version.
	@ldconfig -p | grep -q 'libpython$(PYVER).so.1.0' || \
	  { echo "installing libpython$(PYVER) for the Triton Python backend stub"; \
	    apt-get update -q && apt-get install -y -q libpython$(PYVER); }
	@# HAProxy serves every model's address (apply starts one per deployment).
	@command -v haproxy >/dev/null || test -x /usr/sbin/haproxy || \
	  { echo "installing haproxy, the proxy in front of every model"; \
	    apt-get update -q && apt-get install -y -q haproxy && \
	    { service haproxy stop >/dev/null 2>&1 || true; }; }
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/tritonctl demo

down: $(STAMP)
	$(BIN)/tritonctl down examples/cpu-demo/plan.yaml

# The fast tier on every core (a file's tests on one worker, so module fixtures run once), then the tests that start
# tritonserver, HAProxy or perf_analyzer, and those that measure the CPU, one at a time with nothing beside them.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile -m "not triton and not alone" tests
	$(BIN)/python -m pytest -q --durations=15 -m "triton or alone" tests

# What travels to a GPU host without network (bench/gpu_host.sh): the trimmed Triton for its Python, the wheels
# tritonctl needs beyond what such a host has (PyTorch, numpy, grpcio, ...), and HAProxy with its Lua library.
GPU_PYTHON ?= 3.12
GPU_WHEELS := tritonclient==2.73.0 python-rapidjson pydantic==2.14.4 pydantic-core==2.50.5 annotated-types \
	typing-inspection highspy
gpu-pack: $(STAMP)
	mkdir -p .gpu/whl .gpu/deb
	$(BIN)/tritonctl bundle --python $(GPU_PYTHON) -o .gpu/triton.tar.xz
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .gpu/whl $(GPU_WHEELS)
	cd .gpu/deb && apt-get download haproxy liblua5.3-0 libopentracing-c-wrapper0 libopentracing1
	du -sh .gpu

clean:
	rm -rf $(VENV) model_repository/cpu-demo model_repository/inss-gpu .tritonctl
