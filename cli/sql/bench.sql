-- The tables `jobfold bench` measures Postgres's own limits with (commits per second, rows per
-- second), created in its scratch database. docker/sqlx.sh applies this file after the
-- migrations, so that the bench's statements on them are checked at compile time too.
CREATE TABLE bench_commits (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v bytea);
CREATE TABLE bench_rows (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v bytea);
