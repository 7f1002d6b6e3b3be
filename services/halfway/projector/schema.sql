-- The read model: a derived view of the journal, in PostgreSQL. It can be dropped and rebuilt
-- by replaying the topics (halfway replay --rebuild), and the rebuilt copy equals the live one.
-- Every row is a pure function of the fold of one task's events (halfway.core.fold), so a
-- redelivered event rewrites the same row. The projector records the journal offsets it has
-- applied in the same transaction as the rows (applied_offsets).
--
-- {schema} is replaced by the target schema name (live: "halfway"; a rebuild writes a fresh
-- schema, compares it with the live one, then swaps them).

CREATE SCHEMA IF NOT EXISTS {schema};

CREATE TABLE IF NOT EXISTS {schema}.tasks (
    task_id          text PRIMARY KEY,
    status           text NOT NULL,          -- requested | running | rejected | finished
    final_state      text,                   -- succeeded | failed | compensated | needs_attention
    needs_attention  boolean NOT NULL,       -- unknown and unchecked, or contradicted
    input            jsonb,
    allowed_tools    jsonb,
    summary          text,                   -- task.finished summary, or task.rejected reason
    steps            integer NOT NULL,
    started_at       timestamptz,
    finished_at      timestamptz,
    updated_at       timestamptz NOT NULL    -- `at` of the task's last applied event
);

CREATE TABLE IF NOT EXISTS {schema}.steps (
    step_id          text PRIMARY KEY,
    task_id          text NOT NULL,
    n                integer NOT NULL,
    tool             text NOT NULL,
    args             jsonb NOT NULL,
    key              text NOT NULL,
    subject          text,
    effect_class     text NOT NULL,
    decided_by       text NOT NULL,
    status           text NOT NULL,          -- intended | in_flight | done | not_done | unknown
    outcome          text,                   -- done | not_done | unknown | null
    evidence         jsonb,
    reason           text,
    source           text,                   -- call | lookup | webhook | operator
    attempts         integer NOT NULL,
    unknowns         integer NOT NULL,       -- how many times it was unknown on the way
    checks           integer NOT NULL,
    last_check       text,                   -- what the last lookup found
    next_check_at    timestamptz,            -- when the harness checks again (null: it will not)
    needs_attention  boolean NOT NULL,
    contradictions   integer NOT NULL,       -- later settlements that disagree (surfaced)
    intended_at      timestamptz NOT NULL,
    settled_at       timestamptz,
    updated_at       timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS steps_task ON {schema}.steps (task_id, n);

CREATE TABLE IF NOT EXISTS {schema}.attempts (
    step_id          text NOT NULL,
    attempt          integer NOT NULL,
    key              text NOT NULL,
    started_at       timestamptz NOT NULL,
    PRIMARY KEY (step_id, attempt)
);

CREATE TABLE IF NOT EXISTS {schema}.checks (
    event_id         text PRIMARY KEY,
    step_id          text NOT NULL,
    at               timestamptz NOT NULL,
    found            text NOT NULL,
    next_check_at    timestamptz
);
-- The projector replaces a step's checks by step id (the step's rows are rewritten whole).
CREATE INDEX IF NOT EXISTS checks_step ON {schema}.checks (step_id);

CREATE TABLE IF NOT EXISTS {schema}.compensations (
    step_id          text PRIMARY KEY,       -- the step being undone
    task_id          text NOT NULL,
    tool             text NOT NULL,
    args             jsonb NOT NULL,
    key              text NOT NULL,
    status           text NOT NULL,
    outcome          text,
    evidence         jsonb,
    reason           text,
    attempts         integer NOT NULL,
    updated_at       timestamptz NOT NULL
);

-- Added with sagas. ADD COLUMN IF NOT EXISTS also migrates a read model made before them.
ALTER TABLE {schema}.tasks ADD COLUMN IF NOT EXISTS aborted_by text;  -- task.aborted: who
ALTER TABLE {schema}.tasks ADD COLUMN IF NOT EXISTS aborted_reason text;  -- and why
ALTER TABLE {schema}.compensations ADD COLUMN IF NOT EXISTS last_check text;
ALTER TABLE {schema}.compensations ADD COLUMN IF NOT EXISTS next_check_at timestamptz;
ALTER TABLE {schema}.compensations
    ADD COLUMN IF NOT EXISTS needs_attention boolean NOT NULL DEFAULT false;

-- Added with fencing and contradictions (issue 10).
ALTER TABLE {schema}.tasks ADD COLUMN IF NOT EXISTS attention text;  -- why a person must look
ALTER TABLE {schema}.tasks ADD COLUMN IF NOT EXISTS not_accepted jsonb;  -- refused decisions
ALTER TABLE {schema}.steps ADD COLUMN IF NOT EXISTS attention text;  -- why this step needs one
ALTER TABLE {schema}.tasks ADD COLUMN IF NOT EXISTS model_questions integer NOT NULL DEFAULT 0;
ALTER TABLE {schema}.tasks ADD COLUMN IF NOT EXISTS tokens_in bigint NOT NULL DEFAULT 0;
ALTER TABLE {schema}.tasks ADD COLUMN IF NOT EXISTS tokens_out bigint NOT NULL DEFAULT 0;
ALTER TABLE {schema}.tasks ADD COLUMN IF NOT EXISTS model_unavailable text;  -- last model.failed
ALTER TABLE {schema}.steps ADD COLUMN IF NOT EXISTS waiting text;  -- e.g. no executor serves it

CREATE TABLE IF NOT EXISTS {schema}.applied_offsets (
    topic            text NOT NULL,
    partition        integer NOT NULL,
    next_offset      bigint NOT NULL,        -- the first offset not yet applied
    PRIMARY KEY (topic, partition)
);

-- Which journal these rows come from. Offsets mean nothing in another Kafka cluster's journal
-- (a new local broker, a restored backup): a projector that finds another cluster here drops
-- the read model and rebuilds it, instead of skipping the new journal's first events.
CREATE TABLE IF NOT EXISTS {schema}.journal_source (
    only_row         boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    kafka_cluster_id text NOT NULL,
    topic            text NOT NULL
);
