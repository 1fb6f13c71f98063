"""memprof.analyse"""
