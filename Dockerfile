# layercast API image: the service only, no torch (the `train` extra is not installed).
#   docker build -t layercast .
#   docker run --rm -p 127.0.0.1:8000:8000 layercast          # embedded SQLite in /app/var
#   docker compose up                                          # with PostgreSQL, see docker-compose.yml
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies and package first, so that code-only changes reuse the layer cache as far as possible.
COPY pyproject.toml README.md ./
COPY app/ ./app/
RUN pip install ".[postgres]"

COPY alembic.ini ./
COPY migrations/ ./migrations/
COPY models/ ./models/

# The package is installed into site-packages, so point the settings at the files under /app
# (app/migrate.py finds alembic.ini through LAYERCAST_ALEMBIC_INI).
ENV LAYERCAST_ALEMBIC_INI=/app/alembic.ini \
    LAYERCAST_MODELS_DIR=/app/models \
    LAYERCAST_DATABASE_URL=sqlite:////app/var/layercast.db

RUN groupadd --system layercast \
    && useradd --system --gid layercast --home-dir /app --no-create-home layercast \
    && mkdir -p /app/var \
    && chown layercast:layercast /app/var
USER layercast

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request, sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status == 200 else 1)"]

CMD ["layercast", "serve", "--host", "0.0.0.0", "--port", "8000"]
