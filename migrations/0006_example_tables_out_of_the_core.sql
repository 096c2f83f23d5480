-- The example handler's business table and the fault tests' audit of business writes are
-- not part of jobfold: `document_index` moves to the examples' own migrations
-- (examples/migrations), `index_writes` to the tests' (tests/migrations).
DROP TABLE IF EXISTS index_writes;
DROP TABLE IF EXISTS document_index;
