"""The synchronous engine core: add requests, step, collect outputs. (Body lands next.)"""
