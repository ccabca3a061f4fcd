"""placeholder"""
def transformer_items(**kw):
    raise NotImplementedError
