# The halfway services' image (docker-compose.yml). The local setup does not use it.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY services ./services
RUN pip install --no-cache-dir .
ENTRYPOINT []
CMD ["halfway", "--help"]
