"""The vocabulary of kvpushd: msgspec Structs and enums, no logic."""
