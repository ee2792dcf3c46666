"""Models: loading a main model or draft (``loading``), the named models installed on demand
(``store``) and the cache folder both keep their files in (``cache``).
"""
