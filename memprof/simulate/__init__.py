"""memprof.simulate"""
