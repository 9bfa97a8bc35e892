# syntax=docker/dockerfile:1
# layercast images, one Dockerfile, three stages that ship:
#   docker build -t layercast .                                   # `api` (default, last stage): no torch
#   docker build --target worker -t layercast-worker .            # `worker`: + torch 2.13.0 (CPU wheels)
#   docker compose up --build                                     # both, with PostgreSQL (docker-compose.yml)
# The API image never contains torch (the `train` extra is installed in the worker image only).

# ---------------------------------------------------------------- build: a virtualenv with the API deps
FROM python:3.11.11-slim-bookworm AS build

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY pyproject.toml README.md ./
COPY app/ ./app/
RUN pip install ".[postgres]"

# ------------------------------------------------ worker-build: the same virtualenv plus torch (CPU only)
FROM build AS worker-build
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
    && pip install ".[postgres,train]"

# ------------------------------------------------------------------- worker: retraining, own process
# Both images own /app/models the same way: compose shares it as the `models` volume (the artifact
# store the worker writes and the API reads), initialised from whichever image mounts it first.
FROM python:3.11.11-slim-bookworm AS worker

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    LAYERCAST_ALEMBIC_INI=/app/alembic.ini \
    LAYERCAST_MODELS_DIR=/app/models \
    LAYERCAST_DATABASE_URL=sqlite:////app/var/layercast.db

WORKDIR /app
COPY --from=worker-build /opt/venv /opt/venv
COPY alembic.ini ./
COPY migrations/ ./migrations/
COPY models/ ./models/
RUN groupadd --system layercast \
    && useradd --system --gid layercast --home-dir /app --no-create-home layercast \
    && mkdir -p /app/var \
    && chown -R layercast:layercast /app/var /app/models
USER layercast
CMD ["layercast", "worker"]

# ------------------------------------------------------------------------------ api: the REST service
FROM python:3.11.11-slim-bookworm AS api

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    LAYERCAST_ALEMBIC_INI=/app/alembic.ini \
    LAYERCAST_MODELS_DIR=/app/models \
    LAYERCAST_DATABASE_URL=sqlite:////app/var/layercast.db \
    LAYERCAST_HOST=0.0.0.0 \
    LAYERCAST_PORT=8000

WORKDIR /app
COPY --from=build /opt/venv /opt/venv
COPY alembic.ini ./
COPY migrations/ ./migrations/
COPY models/ ./models/
RUN groupadd --system layercast \
    && useradd --system --gid layercast --home-dir /app --no-create-home layercast \
    && mkdir -p /app/var \
    && chown -R layercast:layercast /app/var /app/models
USER layercast

EXPOSE 8000
# liveness only (/healthz touches nothing else); orchestrators route traffic on /readyz
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status == 200 else 1)"]

# `layercast serve` applies the migrations (a no-op when up to date), then runs uvicorn
CMD ["layercast", "serve"]
