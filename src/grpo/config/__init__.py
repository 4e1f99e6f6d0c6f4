"""The run's configuration: its schema and checks (schema), the bounded YAML reader
(safe_yaml) and the generated reference of every key (docs)."""
