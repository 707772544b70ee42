try:
    {}["missing"]
except KeyError as e:
    raise RuntimeError("wrapped") from e
