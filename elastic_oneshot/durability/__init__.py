"""The commit protocol, the state, storage, records, boundaries and the export's destination."""
