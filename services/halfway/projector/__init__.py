"""The projector: the journal folded into a PostgreSQL read model that can be dropped and
rebuilt (`rebuild`), and that equals the rebuilt copy row for row.

- `rows`: the rows of one task, a pure function of its fold;
- `store`: asyncpg: migrate, write a batch (rows and offsets in one transaction), snapshot;
- `service`: `Projector`, the consumer loop; `serve()` is the process entry point;
- `rebuild`: replay into a fresh schema, compare with the live one, swap.
"""
