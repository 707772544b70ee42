import warnings
warnings.warn("careful")
print("after")
