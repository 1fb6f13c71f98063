"""memprof.record"""
