# ironcell for macOS (and any Docker host): the Linux VM's kernel provides Landlock and seccomp.
#
#   docker build -t ironcell .
#   docker run -i --rm ironcell            # MCP on stdin/stdout; configure your client with this
#
# The container needs no extra privileges: ironcell sandboxes each worker itself. Check first
# with `docker run --rm ironcell doctor`: it shows whether the VM's kernel and Docker's seccomp
# profile let ironcell apply every layer (it refuses to run code otherwise). Mount a
# proxied-servers config with -v and -e MCP_BRIDGE_CONFIG=/config/servers.json if you want
# ironcell to call other MCP servers that exist inside the container.

FROM rust:1-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends python3.11-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs clippy.toml ./
COPY .cargo .cargo
COPY src src
COPY python python
COPY sandbox-policy sandbox-policy
RUN cargo build --release --locked && strip target/release/ironcell

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends \
        libpython3.11 python3.11 python3-numpy python3-pandas python3-matplotlib tzdata \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 ironcell
COPY --from=build /src/target/release/ironcell /usr/local/bin/ironcell
USER ironcell
ENV MCP_BRIDGE_STATE_DIR=/home/ironcell/state
ENTRYPOINT ["/usr/local/bin/ironcell"]
CMD ["serve"]
